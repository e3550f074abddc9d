"""A stand-in for ``python -m controlplane.profiling`` (standard library only, so it starts
at once): it takes the same arguments, appends ``start``/``end`` lines with its wall-clock
times and ZCTL_HOME (- when unset) to the file FAKE_PROFILE_LOG names, measures nothing for
FAKE_PROFILE_SECONDS, and prints the profile JSON that FAKE_PROFILE_JSON holds."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def note(event: str) -> None:
    with open(os.environ["FAKE_PROFILE_LOG"], "a") as log:
        log.write(f"{event} {time.time():.6f} {os.environ.get('ZCTL_HOME') or '-'} "
                  f"{'--turn-held' in sys.argv}\n")


def main() -> int:
    note("start")
    time.sleep(float(os.environ.get("FAKE_PROFILE_SECONDS", "0.3")))
    note("end")
    print(Path(os.environ["FAKE_PROFILE_JSON"]).read_text(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
