"""zctl against llama.cpp's RPC backend and llama-server on the same PCs (``zctl bench
peers``): the pinned source and its build for this CPU (``source``, ``cpu``, ``build``),
the GGUF files paired by bits (``gguf``, ``models``), the delaying relay in front of each
RPC server and the check that it adds what zctl's link layer adds (``relay``, ``links``),
llama.cpp's processes and their layer placement (``processes``, ``placement``), the two
systems as a case sees them (``systems``), the measurements and cases (``measure``,
``cases``), the greedy check (``greedy``), ratios, targets and tables (``report``), and the
command line (``cli``).
"""
