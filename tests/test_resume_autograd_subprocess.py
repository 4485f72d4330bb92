"""DADAutogradLinear checkpoint/resume in a fresh process, both update modes: bitwise equal to a straight run."""

import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """
    import sys, torch
    import torch_dad as td

    mode, folder = sys.argv[1:3]

    def build(update):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            td.DADAutogradLinear(10, 16, num_classes=3, activation="relu", update=update, lr=1e-2),
            td.DADAutogradLinear(16, 3, num_classes=3, update=update, lr=1e-2),
        )
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-2) if update == "grad" else None
        return model, opt

    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(8, 10, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(8)]

    def run(model, opt, part):
        for x, y in part:
            with td.label_context(model, y):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                if opt is not None:
                    opt.zero_grad()
                loss.backward()
                if opt is not None:
                    opt.step()

    for update in ("inplace", "grad"):  # each from its own seed, so the order changes nothing
        model, opt = build(update)
        path, out = f"{folder}/c-{update}.pt", f"{folder}/{mode}-{update}.pt"
        if mode == "first":
            run(model, opt, batches[:4])
            torch.save({"model": model.state_dict(), "opt": opt.state_dict() if opt else None}, path)
        elif mode == "second":
            torch.manual_seed(77)
            state = torch.load(path)
            model.load_state_dict(state["model"])
            if opt is not None:
                opt.load_state_dict(state["opt"])
            run(model, opt, batches[4:])
            torch.save({"model": model.state_dict(), "opt": opt.state_dict() if opt else None}, out)
        else:
            run(model, opt, batches)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict() if opt else None}, out)
    """
)


def _tensors(obj, prefix=""):
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_tensors(v, f"{prefix}.{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_tensors(v, f"{prefix}.{i}"))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The folder of both update modes' checkpoint, resumed and straight runs: three processes in all."""
    folder = tmp_path_factory.mktemp("autograd-resume")
    script = folder / "job.py"
    script.write_text(SCRIPT)
    for mode in ("first", "second", "straight"):
        subprocess.run([sys.executable, str(script), mode, str(folder)], check=True)
    return folder


@pytest.mark.parametrize("update", ["inplace", "grad"])
def test_autograd_resume_in_fresh_process_is_bitwise(runs, update):
    ckpt, resumed, straight = (str(runs / f"{n}-{update}.pt") for n in ("c", "second", "straight"))
    a, b = _tensors(torch.load(resumed)), _tensors(torch.load(straight))
    assert a.keys() == b.keys() and len(a) >= 4
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # the layers really trained
    first = _tensors(torch.load(ckpt))
    assert any(not torch.equal(first[k], b[k]) for k in first if k.startswith(".model"))
