"""The README's notebook snippet runs as written, and the demo works end to end."""

import os
import re

import pytest

from helpers.tiny_setup import ROOT, cli


SCHEMES = ("rope", "alibi", "nope", "so2_learned_qkv")


def test_readme_notebook_snippet_runs():
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme.split("## Call the attention functions from a notebook")[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})


def test_demo_trains_evaluates_and_reports(tmp_path, monkeypatch):
    """demo.run in this process on the fast configs, with fewer steps and eval lengths, and the
    baseline schemes only: `demo.py --fast` itself (every demo scheme, 60 steps, six lengths,
    about three minutes) is the slow test below."""
    import demo
    from configs import demo as demo_configs
    fast_config = demo_configs.get_config

    def shortened(arg):
        assert arg.endswith("/fast")
        c = fast_config(arg)
        c.train.update(steps=4, warmup_steps=2, log_every=2, checkpoint_every=4)
        c.eval.update(multipliers=(0.5, 1, 2), tokens=256)
        return c

    monkeypatch.setattr(demo_configs, "get_config", shortened)
    monkeypatch.chdir(tmp_path)
    table = demo.run(SCHEMES, fast=True)
    for scheme in SCHEMES:
        assert f"| {scheme} | {scheme} |" in table
    out = tmp_path / "runs" / "demo-fast" / "compare"
    assert (out / "results.png").exists() and (out / "results.json").exists()


@pytest.mark.slow
def test_fast_demo_trains_evaluates_and_reports(tmp_path):
    run = cli(os.path.join(ROOT, "demo.py"), "--fast", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    for scheme in SCHEMES:
        assert f"| {scheme} | {scheme} |" in run.stdout
    out = tmp_path / "runs" / "demo-fast" / "compare"
    assert (out / "results.png").exists() and (out / "results.json").exists()
