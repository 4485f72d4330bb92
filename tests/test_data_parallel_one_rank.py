"""``DataParallelTrainer`` at world size 1 is ``DADTrainer``: no reducers, the same state bit for bit on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.test_parallel import _free_port

pytestmark = pytest.mark.slow  # a fresh Python process with a gloo group

SCRIPT = textwrap.dedent(
    """
    import json, os, torch, torch.distributed as dist
    import torch_dad as td
    from torch_dad import data
    from torch_dad.training import DataParallelTrainer, checkpoint

    class Net(td.DADModel):
        def __init__(self):
            super().__init__()
            self.l1 = td.DADLinear(12, 20, num_classes=3)
            self.l2 = td.DADLinear(20, 9, num_classes=3, activation="tanh")
            self.classifier = torch.nn.Linear(9, 3)

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
    dist.init_process_group("gloo", rank=0, world_size=1)
    (x, y), test = data.synthetic(num_train=200, num_test=40, num_features=12, num_classes=3, seed=5)
    states, reducers = [], []
    for make in (td.DADTrainer, DataParallelTrainer):
        torch.manual_seed(0)
        trainer = make(Net(), classifier_sample_size=50, dropout=0.1)
        reducers.append([trainer.gradient_reducer is None, trainer.statistics_reducer is None])
        records = trainer.fit((x, y), epochs=2, batch_size=16, eval=test, progress=False)
        trainer.solve_head()
        for record in records:
            del record["train_s"], record["img_per_s"]
        states.append((checkpoint.flatten(trainer.state_dict())[1], records, trainer.evaluate(test)))
    (a, ra, ea), (b, rb, eb) = states
    print(json.dumps({"reducers": reducers, "same_keys": a.keys() == b.keys(),
                      "different": [k for k in a if not torch.equal(a[k], b[k])], "records": ra == rb,
                      "evaluate": ea == eb}))
    dist.destroy_process_group()
    """
)


def test_data_parallel_at_world_size_one_is_the_single_process_trainer():
    env = {"PORT": str(_free_port()), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env={**os.environ, **env})
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out == {"reducers": [[True, True], [True, True]], "same_keys": True, "different": [], "records": True,
                   "evaluate": True}, out
