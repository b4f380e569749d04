"""The README's notebook snippet runs as written, and the fast demo works end to end."""

import os
import re

from tiny_setup import ROOT, cli


def test_readme_notebook_snippet_runs():
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme.split("## Call the attention functions from a notebook")[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})


def test_fast_demo_trains_evaluates_and_reports(tmp_path):
    run = cli(os.path.join(ROOT, "demo.py"), "--fast", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    for scheme in ("rope", "alibi", "nope", "so2_learned_qkv"):
        assert f"| {scheme} | {scheme} |" in run.stdout
    out = tmp_path / "runs" / "demo-fast" / "compare"
    assert (out / "results.png").exists() and (out / "results.json").exists()
