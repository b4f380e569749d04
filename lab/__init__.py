"""The runs library, between the model and data packages and the entry points: the train
state and its initialisation (`lab.state`), checkpoint I/O (`lab.checkpoints`), the training
loop (`lab.training`), loading a trained run (`lab.runs`), the named evaluators
(`lab.evaluators`, with `lab.lengths`, `lab.probes`, `lab.analysis`) and the command-line
helpers (`lab.cli`). `train.py`, `eval.py`, `analyze.py` and `demo.py` are thin flags over it;
a notebook imports it from anywhere once the package is installed:

    from lab.runs import load_run
    config, model, step = load_run("runs/rope")
"""
