"""Issue 7: Horovod elastic. Three workers on localhost; the host discovery script drops one slot mid-run;
training continues on two ranks, consistent, with every rank's compression memory reset on the change."""
import json
import stat
from collections import defaultdict

from tests.harness import HOROVODRUN, run_command
import sys


def test_elastic_shrink_from_three_to_two(tmp_path):
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\nif [ -f {tmp_path}/shrink ]; then echo localhost:2; else echo localhost:3; fi\n")
    discover.chmod(discover.stat().st_mode | stat.S_IEXEC)
    cmd = [HOROVODRUN, "-np", "3", "--min-np", "2", "--max-np", "3", "--network-interface", "lo",
           "--host-discovery-script", str(discover), "--gloo", sys.executable, "-m", "tests.elastic_worker"]
    rc, out, seconds = run_command(cmd, timeout=240, env={"HAT_ELASTIC_DIR": str(tmp_path)})
    assert rc == 0, out[-5000:]
    rows = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    by_batch = defaultdict(list)
    for r in rows:
        by_batch[r["batch"]].append(r)
    assert max(by_batch) == 40
    sizes = [sorted({r["size"] for r in by_batch[b]}) for b in sorted(by_batch)]
    assert sizes[0] == [3] and sizes[-1] == [2]
    for b, entries in by_batch.items():
        assert len({e["digest"] for e in entries}) == 1, f"ranks disagree at batch {b}"
        assert len(entries) == entries[0]["size"]
    final = by_batch[40]
    assert all(len(e["resets"]) >= 1 and e["resets"][-1] == 0 for e in final), final  # memory emptied on reset
