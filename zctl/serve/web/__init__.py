"""The web page: its files (static/) and routes, and the live cluster view it shows."""
