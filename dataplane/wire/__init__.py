"""The data plane's wire: the frames that travel between stages (``frames``: headers,
payloads and the timing records stamped into them; the payloads of CANCEL and PREFIX
frames in ``cancels`` and ``prefix_ops``, the last stage's answer records in
``reply_records``), the timing read back from them (``timing``), and the PUSH/PULL pipes
that carry them (``transport``: sockets, their options and CURVE, buffers in flight;
``pipes``: a hop's two; an emulated WAN link in ``link``). No OpenVINO here, and nothing of
the stage runtimes.
"""
