"""The data plane's wire: the frames that travel between stages (``frames``: headers,
payloads, CANCEL marks in ``cancels``, the last stage's answer records in
``reply_records``), the timing records they carry (``timing``), and the PUSH/PULL pipes
that carry them (``transport``, ``pipes``; an emulated WAN link in ``link``). No
OpenVINO here.
"""
