"""A stage's KV bookkeeping (pure, or numpy over the runner's state): slot tables and row
groups (``slots``, ``rows``), attention masks over physical slots (``masks``), blocks of
a paged stage (``blocks``), and a stateful stage's prefix entries (``prefix_entries``).
"""
