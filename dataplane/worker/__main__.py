"""The stage-worker process: load one stage of an export and serve it until signalled.

``python -m dataplane.worker EXPORT --stage K --bind ADDR --send-to ADDR`` prints
``ready <endpoint>`` once serving; tests,
benchmarks and bare deployments use it (a cluster node runs its worker inside the node
agent instead, see controlplane.launch).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from dataplane.runtime.config import RuntimeSpec
from dataplane.runtime.load import load_runner
from dataplane.wire.transport import PipeOptions
from dataplane.worker.stage_worker import StageWorker


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m dataplane.worker.stage_worker",
                                     description="Serve one stage shard of an export.")
    parser.add_argument("export_dir")
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--bind", required=True, help="inbound address, e.g. tcp://127.0.0.2:*")
    parser.add_argument("--send-to", required=True, help="next stage or coordinator reply address")
    parser.add_argument("--device", default="CPU")
    parser.add_argument("--precision", default="f32", help="INFERENCE_PRECISION_HINT; 'default' "
                                                           "keeps the plugin's")
    parser.add_argument("--threads", type=int, default=None, help="INFERENCE_NUM_THREADS")
    parser.add_argument("--kv-cache-precision", default="default",
                        help="KV cache element type (f32, u8, ...); 'default' keeps the plugin's")
    parser.add_argument("--no-dynamic-quantization", action="store_true",
                        help="f32 activations (no dynamic int8 quantization of matmul inputs)")
    parser.add_argument("--link-delay-ms", type=float, default=0.0,
                        help="emulated one-way latency added to every frame sent on")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Node entry point: load the stage, print ``ready <endpoint>``, serve until SIGTERM/SIGINT."""
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # Threads started from here on (OpenVINO's, ZeroMQ's) inherit a mask that blocks
    # SIGTERM/SIGINT, so the kernel delivers them to the main thread, whose blocking
    # recv then returns EINTR and raises KeyboardInterrupt. Otherwise a signal taken by
    # another thread can leave the main thread asleep in recv.
    stop_signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    config = RuntimeSpec(device=args.device, num_threads=args.threads,
                         precision=None if args.precision == "default" else args.precision,
                         kv_cache_precision=None if args.kv_cache_precision == "default"
                         else args.kv_cache_precision,
                         dynamic_quantization=not args.no_dynamic_quantization)
    runner = load_runner(args.export_dir, args.stage, config)
    worker = StageWorker(runner, args.bind, args.send_to,
                         options=PipeOptions(delay_ms=args.link_delay_ms))
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # exit the loop like Ctrl-C
    signal.pthread_sigmask(signal.SIG_UNBLOCK, stop_signals)
    print(f"ready {worker.endpoint}", flush=True)
    try:
        worker.run()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
