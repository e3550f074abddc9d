"""The process entry ``python -m zctl.launcher coordinator|node CONFIG_JSON``.

Not a command line for people (that is ``zctl``): the one argument is the typed
configuration ``zctl.launcher.processes.process_command`` wrote, rebuilt into the same
dataclass and run. Errors are one clear line and a non-zero exit.
"""

from __future__ import annotations

import logging
import sys

from zctl.launcher.processes import CoordinatorProcess, parse_process, run_coordinator, run_node

USAGE = "usage: python -m zctl.launcher coordinator|node CONFIG_JSON (see zctl.launcher.processes)"


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        say(USAGE)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        config = parse_process(args[0], args[1])
        if isinstance(config, CoordinatorProcess):
            return run_coordinator(config, say)
        return run_node(config, say)
    except KeyboardInterrupt:
        return 130
    except (OSError, ValueError, RuntimeError) as exc:
        say(f"error: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
