"""Issue 7 / 31: Horovod elastic on one host with a plain ``hvd.elastic.TorchState(model, optimizer)`` and no
reset callback. Three workers shrink to two (Horovod skips ``sync()``), two grow to three (a new worker with
an empty AdamW state joins): training continues bitwise identical on every rank, every rank agrees on the
round, and each survivor's residuals are kept, scaled by W_new / W_old (horovod_adtopk.elastic)."""
import json
import stat
import sys
from collections import defaultdict

import pytest
import torch

from tests.harness import HOROVODRUN, run_command


def run_elastic(tmp_path, mode: str, start: int, after: int):
    discover = tmp_path / "discover.sh"
    if mode == "kill":  # two local "hosts": Horovod blacklists the failed one, the other goes on
        discover.write_text("#!/bin/sh\necho localhost:2\necho 127.0.0.1:1\n")
    else:
        discover.write_text(f"#!/bin/sh\nif [ -f {tmp_path}/change ]; then echo localhost:{after}; "
                            f"else echo localhost:{start}; fi\n")
    discover.chmod(discover.stat().st_mode | stat.S_IEXEC)
    cmd = [HOROVODRUN, "-np", str(start), "--min-np", "2", "--max-np", "3", "--network-interface", "lo",
           "--host-discovery-script", str(discover), "--gloo", sys.executable, "-m", "tests.elastic_worker", mode]
    rc, out, seconds = run_command(cmd, timeout=240, env={"HAT_ELASTIC_DIR": str(tmp_path)})
    assert rc == 0, out[-5000:]
    rows = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    by_batch, by_key = defaultdict(list), defaultdict(list)
    for r in rows:
        by_batch[r["batch"]].append(r)
        by_key[(r["batch"], r["size"])].append(r)  # a step replayed after a failure logs again at the new size
    assert max(by_batch) == 40, out[-5000:]
    sizes = [sorted({r["size"] for r in by_batch[b]}) for b in sorted(by_batch)]
    assert sizes[0] == [start] and sizes[-1] == [after], sizes
    for (b, size), entries in by_key.items():
        assert len({e["digest"] for e in entries}) == 1, f"ranks disagree at batch {b}: {entries}"
        assert len({e["round"] for e in entries}) == 1, f"ranks disagree on the round at batch {b}: {entries}"
        assert len(entries) == size, entries
    return by_batch


def by_key(by_batch):
    out = defaultdict(list)
    for entries in by_batch.values():
        for e in entries:
            out[(e["batch"], e["size"])].append(e)
    return out


def check_rescaled(tmp_path, start: int, after: int, survivors: int):
    """Each survivor's residuals on re-entry == its residuals at the commit before the change x after/start
    (bitwise); a worker that joined holds none."""
    kept = 0
    for path in sorted(tmp_path.glob(f"after_*_{after}.pt")):
        now = torch.load(path, weights_only=True)
        assert now["size"] == after
        before_path = tmp_path / f"commit_{path.name.split('_')[1]}_{start}.pt"
        before = torch.load(before_path, weights_only=True) if before_path.exists() else None
        if before is None:  # the joined worker: committed only in the new world
            assert now["residuals"] == {}, "a new worker must start with empty residuals"
            continue
        assert now["residuals"].keys() == before["residuals"].keys() and now["residuals"]
        for name, r in before["residuals"].items():
            assert torch.equal(now["residuals"][name], r * (after / start)), name
        kept += 1
    assert kept == survivors, f"{kept} survivors' residuals checked, expected {survivors}"


def test_elastic_shrink_from_three_to_two(tmp_path):
    by_batch = run_elastic(tmp_path, "shrink", 3, 2)
    final = by_batch[40]
    assert all(e["elastic"]["membership_changes"] == 1 and e["elastic"]["world_sizes"] == [3, 2] for e in final), final
    assert all(e["elastic"]["residual_scale"] == [pytest.approx(2 / 3)] for e in final)
    # the lazy path: the change is seen at the next exchange, so residuals on re-entry are still the old ones
    paths = sorted(tmp_path.glob("after_*_2.pt"))
    assert len(paths) == 2, paths
    for path in paths:
        now = torch.load(path, weights_only=True)
        before = torch.load(tmp_path / f"commit_{path.name.split('_')[1]}_3.pt", weights_only=True)
        assert now["residuals"]
        for name, r in before["residuals"].items():
            assert torch.equal(now["residuals"][name], r), name


def test_elastic_grow_from_two_to_three_with_adamw(tmp_path):
    by_batch = run_elastic(tmp_path, "grow", 2, 3)
    check_rescaled(tmp_path, 2, 3, survivors=2)
    final = by_batch[40]
    joined = [e for e in final if e["elastic"]["world_sizes"][0] == 3]
    assert len(joined) == 1, final
    assert all(e["elastic"]["residual_scale"] == [1.5] for e in final if e not in joined), final
    # local steps in the same TorchState: every rank on the same interval position and sync count, and on
    # the same parameters right after every sync, before and after the join
    for (b, size), entries in by_key(by_batch).items():
        local = [e["local"] for e in entries]
        assert len({(l["step_in_interval"], l["syncs"]) for l in local}) == 1, (b, local)
        if local[0]["step_in_interval"] == 0:
            assert len({l["digest"] for l in local}) == 1, f"local-steps ranks differ after the sync of batch {b}"
    assert any(size == 3 and es[0]["local"]["step_in_interval"] == 0 for (b, size), es in by_key(by_batch).items())
    assert all(e["local"]["elastic"]["world_sizes"][-1] == 3 for e in by_batch[40])
    # hierarchical=True: the flat fallback under elastic, stated (process sets are not re-created)
    assert all("Horovod elastic" in e["hierarchical"] for e in final), final


FOLD_SPECS = [{"compressor": "adtopk", "kwargs": {"ratio": 0.05}},
              {"compressor": "dgc", "kwargs": {"ratio": 0.05, "momentum": 0.9}}]


def test_gathered_checkpoint_folds_residuals_into_another_world_size():
    """A checkpoint of every rank's state written at 3 ranks, resumed at 2 (an elastic restart): new rank j
    holds (2/3) * sum of old ranks i with i mod 2 == j, so sum_j r'_j / 2 == sum_i r_i / 3 (numpy reference);
    residuals and, with momentum correction, velocities."""
    import numpy as np
    from pathlib import Path
    from tests.harness import run_ranks
    from tests.reference import check_fold_3_to_2

    steps = 4
    first = run_ranks("fold_resume", np=3, args={"phase": "write", "steps": steps, "specs": FOLD_SPECS}, timeout=180)
    second = run_ranks("fold_resume", np=2, timeout=180,
                       args={"phase": "read", "steps": steps, "specs": FOLD_SPECS, "first_dir": first[0]["outdir"]})
    for si, spec in enumerate(FOLD_SPECS):
        assert [r[str(si)]["round"] for r in second] == [steps, steps]
        assert second[0][str(si)]["digest"] == second[1][str(si)]["digest"]
        saved = torch.load(Path(first[0]["outdir"], f"ckpt{si}.pt"), weights_only=True)["optimizer"]["horovod_adtopk"]
        assert saved["world_size"] == 3 and sorted(saved["ranks"]) == [0, 1, 2]
        stores = ["residuals"] + (["velocities"] if spec["kwargs"].get("momentum") else [])
        for store in stores:
            names = saved["ranks"][0]["memory"][store].keys()
            assert names, (spec, store)
            for name in names:
                new = [np.load(Path(second[j]["outdir"], f"fold{si}_rank{j}.npz"))[f"{store}/{name}"] for j in range(2)]
                check_fold_3_to_2(saved["ranks"], store, name, new)


def test_elastic_sigkill_rolls_residuals_back_with_the_model(tmp_path):
    """A worker dies one full step after the last commit: the survivors' next exchange fails, restore() takes
    the model, the optimizer and the residuals back to that commit together (the step in between had changed
    the residuals), sync() rescales them by 2/3 (bitwise checked), training goes on at 2 with every rank
    identical; the uncommitted step is replayed from the commit, not applied twice."""
    by_batch = run_elastic(tmp_path, "kill", 3, 2)
    check_rescaled(tmp_path, 3, 2, survivors=2)
    # step 16 ran at 3 and, after the failure in step 17, again at 2 (replayed from the commit of step 15)
    assert sorted(e["size"] for e in by_batch[16]) == [2, 2, 3, 3, 3], by_batch[16]
    assert sorted(e["size"] for e in by_batch[17]) == [2, 2], by_batch[17]
    assert all(e["elastic"]["membership_changes"] == 1 for e in by_batch[40]), by_batch[40]
