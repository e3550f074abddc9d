"""LAN discovery: a coordinator announces its cluster with DNS-SD over multicast DNS;
nodes and ``zctl cluster ls`` find it. ``records`` reads and checks what is announced
(pure), ``interfaces`` picks where to announce, ``announcer`` and ``browser`` speak mDNS
(python-zeroconf)."""
