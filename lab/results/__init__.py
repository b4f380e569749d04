"""The results pages' tools (docs/results/*.md): each is a module here and a command,
`python -m lab.results.<tool> ...` (absl flags; `--help` lists them):

  seeds      mean +- std over seeds from eval reports, metrics or its own json: a page's table,
             its json and plot
  claims     the claims ledger (docs/results/claims.md): paired intervals over seeds and over
             evaluation documents, and the papers' results beside them
  documents  intervals over the evaluation documents of one eval report
  retrieval_merge                one retrieval report from runs evaluated one at a time
  position_generalization_seeds  the feature-shift and decomposition tables over seeds
"""

import os

# The results pages and their json (a source checkout's docs/results).
PAGES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs", "results")
