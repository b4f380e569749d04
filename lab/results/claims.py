"""The claims ledger: each comparison a results page makes over seeds, recomputed from the
committed per-seed json as a paired 95% t interval with one verdict rule (`lab.stats.verdict`),
written to docs/results/claims.md. tests/project/test_claims.py regenerates it and fails where the
committed file differs.

    python -m lab.results.claims            # rewrites docs/results/claims.md

A claim compares arm A with arm B of one json (lab/results/seeds.py's format: per arm, seeds
and values [seed, column]) seed by seed, on one measure:
  ratio  log(ppl at a length / ppl at the training length): how much more A degrades than B
  ppl    log perplexity at a length
  acc    accuracy (absolute)
and states the sign of A - B it claims. Log measures are shown as A / B - 1 (a relative change).
Where the json holds each seed's documents (seeds.py's per_document), a second interval takes the
evaluation documents as the sample instead: each document's A - B (its own log perplexity, or
log ratio, averaged over the seeds), Student's t over the documents. A claim that holds for the
text as well as for the seeds is supported in both.
Against the papers: docs/results/paper_claims.json says, per claim id, what the paper reports on
the same comparison (where, a verbatim quote to find it by, the direction against the claim:
"same", "opposite" or "none" where the paper has no such result), rendered as a second table
beside our verdict.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

from absl import app

from lab.results import PAGES
from lab.stats import paired, verdict

HERE = PAGES  # the claims' json and the ledger's page

# (page, the claim's id (the page tags it `[claim <id>: <verdict>](claims.md)`), the claim, json, arm A, arm B, measure, column, training length, claimed sign of A - B)
CLAIMS = [
    ("accumulated.md", "acc-learned-qkv-rope-64x", "learned Q/K/V rotations degrade less than RoPE at 64x", "accumulated_seeds.json",
     "so2_learned_qkv", "rope", "ratio", 8192, 128, "negative"),
    ("accumulated.md", "acc-learned-qkv-qk-64x", "learned Q/K/V degrade less than learned Q/K at 64x", "accumulated_seeds.json",
     "so2_learned_qkv", "so2_learned_qk", "ratio", 8192, 128, "negative"),
    ("accumulated.md", "acc-learned-qkv-qk-train", "learned Q/K/V: lower perplexity than learned Q/K at the training length",
     "accumulated_seeds.json", "so2_learned_qkv", "so2_learned_qk", "ppl", 128, 128, "negative"),
    ("accumulated.md", "acc-random-qkv-qk-64x", "random Q/K/V degrade less than random Q/K at 64x (the page: not resolved)",
     "accumulated_seeds.json", "so2_random_qkv", "so2_random_qk", "ratio", 8192, 128, "negative"),
    ("accumulated.md", "acc-rope-qkv-rope-64x", "RoPE on Q/K/V degrades less than RoPE at 64x (the page: not resolved)",
     "accumulated_seeds.json", "rope_qkv", "rope", "ratio", 8192, 128, "negative"),
    ("accumulated.md", "acc-alibi-rope-train", "ALiBi: higher perplexity than RoPE at the training length", "accumulated_seeds.json",
     "alibi", "rope", "ppl", 128, 128, "positive"),
    ("accumulated.md", "acc-learned-alibi-train", "learned Q/K/V + ALiBi: lower perplexity than learned Q/K/V at the training length",
     "accumulated_seeds.json", "so2_learned_qkv+alibi", "so2_learned_qkv", "ppl", 128, 128, "negative"),
    ("accumulated.md", "acc-learned-alibi-64x", "learned Q/K/V + ALiBi degrade less than learned Q/K/V at 64x",
     "accumulated_seeds.json", "so2_learned_qkv+alibi", "so2_learned_qkv", "ratio", 8192, 128, "negative"),
    ("espr.md", "espr-rope-64x", "ESPR degrades less than RoPE at 64x", "espr_lm_seeds.json", "espr", "acc_rope", "ratio",
     8192, 128, "negative"),
    ("path.md", "path-fox-fox-train", "PaTH-FoX: lower perplexity than FoX at the training length", "path_seeds.json", "path_fox",
     "fox", "ppl", 128, 128, "negative"),
    ("path.md", "path-fox-rope-64x", "PaTH-FoX degrades less than RoPE at 64x", "path_seeds.json", "path_fox", "rope", "ratio",
     8192, 128, "negative"),
    ("path.md", "path-rope-64x", "PaTH degrades less than RoPE at 64x", "path_seeds.json", "path", "rope", "ratio", 8192, 128,
     "negative"),
    ("path.md", "path-so2-rope-64x", "learned SO(2) transport degrades less than RoPE at 64x", "path_seeds.json",
     "so2_learned_qkv", "rope", "ratio", 8192, 128, "negative"),
    ("sessa.md", "sessa-mqar-transformer", "Sessa: higher Diffuse MQAR accuracy than the Transformer", "sessa_mqar_seeds.json", "sessa",
     "transformer", "acc", "all", None, "positive"),
    ("sessa.md", "sessa-mqar-nofb", "Sessa: higher Diffuse MQAR accuracy than its no-feedback ablation", "sessa_mqar_seeds.json",
     "sessa", "sessa_nofb", "acc", "all", None, "positive"),
    ("sessa.md", "sessa-lm-transformer", "LM: the Transformer better than Sessa (the paper's claim; the page: reproduced)",
     "sessa_lm_seeds.json", "sessa", "transformer", "ppl", 128, None, "positive"),
    ("sessa.md", "sessa-lm-nofb", "LM: removing Sessa's feedback helps (the paper's claim; the page: same shape)",
     "sessa_lm_seeds.json", "sessa_nofb", "sessa", "ppl", 128, None, "negative"),
    ("accumulated.md", "acc-learned-qkv-rope-64x-5", "learned Q/K/V rotations degrade less than RoPE at 64x (5 new seeds, "
     "8 documents)", "accumulated_sweep5.json", "so2_learned_qkv", "rope", "ratio", 8192, 128, "negative"),
    ("accumulated.md", "acc-learned-qkv-rope-train-5", "learned Q/K/V rotations: lower perplexity than RoPE at the training "
     "length (5 new seeds, 8 documents)", "accumulated_sweep5.json", "so2_learned_qkv", "rope", "ppl", 128, None,
     "negative"),
    ("espr.md", "espr-rope-64x-5", "ESPR degrades less than RoPE at 64x (5 new seeds, 8 documents)", "espr_sweep5.json",
     "espr", "rope", "ratio", 8192, 128, "negative"),
    ("path.md", "path-fox-fox-train-5", "PaTH-FoX: lower perplexity than FoX at the training length (5 new seeds, 8 "
     "documents)", "path_fox_sweep5.json", "path_fox", "fox", "ppl", 128, None, "negative"),
    ("sweep.md", "sweep-alibi-rope-16x", "demo-fast model, 400 steps: ALiBi degrades less than RoPE at 16x",
     "sweep_demo_fast.json", "alibi/fast", "rope/fast", "ratio", 2048, 128, "negative"),
    ("sweep.md", "sweep-fox-alibi-train", "demo-fast model, 400 steps: FoX lower perplexity than ALiBi at the training "
     "length", "sweep_demo_fast.json", "fox/fast", "alibi/fast", "ppl", 128, None, "negative"),
    ("sessa.md", "sessa-mqar-transformer-5", "Sessa: higher Diffuse MQAR accuracy than the Transformer (5 new seeds)",
     "sessa_mqar_sweep5.json", "mqar/sessa", "mqar/transformer", "acc", "all", None, "positive"),
    ("sessa.md", "sessa-mqar-nofb-5", "Sessa: higher Diffuse MQAR accuracy than its no-feedback ablation (5 new seeds)",
     "sessa_mqar_sweep5.json", "mqar/sessa", "mqar/sessa_nofb", "acc", "all", None, "positive"),
    ("sessa.md", "sessa-lm-transformer-5", "LM: the Transformer better than Sessa (the paper's claim; 5 new seeds, 8 "
     "documents)", "sessa_lm_sweep5.json", "lm/sessa", "lm/transformer", "ppl", 128, None, "positive"),
    ("sessa.md", "sessa-lm-nofb-5", "LM: removing Sessa's feedback helps (the paper's claim; 5 new seeds, 8 documents)",
     "sessa_lm_sweep5.json", "lm/sessa_nofb", "lm/sessa", "ppl", 128, None, "negative"),
    ("path.md", "path-rope-64x-5", "PaTH degrades less than RoPE at 64x (5 new seeds, 8 documents)", "path_sweep5.json",
     "path", "rope", "ratio", 8192, 128, "negative"),
    ("path.md", "path-fox-rope-64x-5", "PaTH-FoX degrades less than RoPE at 64x (5 new seeds, 8 documents)",
     "path_sweep5.json", "path_fox", "rope", "ratio", 8192, 128, "negative"),
    ("sweep.md", "sweep-t5-rope-16x", "demo-fast model, 400 steps: T5's bucketed bias degrades less than RoPE at 16x",
     "sweep_demo_fast_t5.json", "t5/fast", "rope/fast", "ratio", 2048, 128, "negative"),
    ("sweep.md", "sweep-alibi-t5-16x", "demo-fast model, 400 steps: ALiBi degrades less than T5's bucketed bias at 16x",
     "sweep_demo_fast_t5.json", "alibi/fast", "t5/fast", "ratio", 2048, 128, "negative"),
    ("tapa.md", "tapa-fair-tapa-rope-ext", "extended to 4L at the paper's learning-rate ratios: TAPA lower perplexity "
     "than RoPE at the extension length (5 seeds, 8 documents)", "tapa_fair_extended.json", "tapa", "rope", "ppl", 512,
     None, "negative"),
    ("tapa.md", "tapa-fair-tapa-rope-2x", "extended at the paper's ratios: TAPA lower perplexity than RoPE at 2x the "
     "extension length", "tapa_fair_extended.json", "tapa", "rope", "ppl", 1024, None, "negative"),
    ("tapa.md", "tapa-fair-yarn-rope-768", "extended at the paper's ratios: YaRN lower perplexity than RoPE at 1.5x the "
     "extension length", "tapa_fair_extended.json", "yarn", "rope", "ppl", 768, None, "negative"),
    ("tapa.md", "tapa-fair-zeroshot-8x", "pretrained at L, no extension: TAPA degrades less than RoPE at 8L",
     "tapa_fair_zeroshot.json", "tapa", "rope", "ratio", 1024, 128, "negative"),
    ("tapa.md", "tapa-10x-zeroshot-8x", "pretrained ten times longer (6,000 steps) at the paper's ratios: TAPA degrades "
     "less than RoPE at 8L", "tapa_10x.json", "tapa", "rope", "ratio", 1024, 128, "negative"),
    ("tapa.md", "tapa-10x-context", "pretrained ten times longer: TAPA gains less from context than RoPE (perplexity at "
     "L/8 over that at L)", "tapa_10x.json", "tapa", "rope", "ratio", 16, 128, "negative"),
    ("espr.md", "espr-relaxed-string-offset40", "2-D grids translated by (40, 40): relaxed ESPR more accurate than STRING "
     "(T8'.21's ordering; 5 seeds)", "espr_shift_penalty.json", "espr_relaxed_2d", "string_2d", "acc", "offset_40_40",
     None, "positive"),
    ("espr.md", "espr-penalised-string-offset40", "translated by (40, 40): relaxed ESPR with a commutator penalty (the "
     "theorems' small-commutator regime) more accurate than STRING (T8'.21)", "espr_shift_penalty.json",
     "espr_relaxed_2d_penalised", "string_2d", "acc", "offset_40_40", None, "positive"),
    ("espr.md", "espr-penalised-relaxed-offset40", "translated by (40, 40): the commutator penalty raises relaxed ESPR's "
     "accuracy (T8'.12-8'.13: the shift risk is bounded by the commutators)", "espr_shift_penalty.json",
     "espr_relaxed_2d_penalised", "espr_relaxed_2d", "acc", "offset_40_40", None, "positive"),
    ("espr.md", "espr-penalised-string-larger", "larger grids than trained (not a translation): relaxed ESPR with the "
     "penalty less accurate than STRING", "espr_shift_penalty.json", "espr_relaxed_2d_penalised", "string_2d", "acc",
     "larger_12x10_14", None, "negative"),
    ("accumulated.md", "acc-learned-qkv-qk-64x-5", "learned Q/K/V degrade less than learned Q/K at 64x (5 new seeds, 8 "
     "documents)", "accumulated_sweep5b.json", "so2_learned_qkv", "so2_learned_qk", "ratio", 8192, 128, "negative"),
    ("accumulated.md", "acc-learned-qkv-qk-train-5", "learned Q/K/V: lower perplexity than learned Q/K at the training "
     "length (5 new seeds, 8 documents)", "accumulated_sweep5b.json", "so2_learned_qkv", "so2_learned_qk", "ppl", 128,
     None, "negative"),
    ("accumulated.md", "acc-random-qkv-qk-64x-5", "random Q/K/V degrade less than random Q/K at 64x (5 new seeds, 8 "
     "documents)", "accumulated_sweep5b.json", "so2_random_qkv", "so2_random_qk", "ratio", 8192, 128, "negative"),
    ("accumulated.md", "acc-rope-qkv-rope-64x-5", "RoPE on Q/K/V degrades less than RoPE at 64x (5 new seeds, 8 "
     "documents)", "accumulated_sweep5b.json", "rope_qkv", "rope", "ratio", 8192, 128, "negative"),
    ("accumulated.md", "acc-alibi-rope-train-5", "ALiBi: higher perplexity than RoPE at the training length (5 new "
     "seeds, 8 documents)", "accumulated_sweep5b.json", "alibi", "rope", "ppl", 128, None, "positive"),
    ("accumulated.md", "acc-learned-alibi-train-5", "learned Q/K/V + ALiBi: lower perplexity than learned Q/K/V at the "
     "training length (5 new seeds, 8 documents)", "accumulated_sweep5b.json", "so2_learned_qkv+alibi", "so2_learned_qkv",
     "ppl", 128, None, "negative"),
    ("accumulated.md", "acc-learned-alibi-64x-5", "learned Q/K/V + ALiBi degrade less than learned Q/K/V at 64x (5 new "
     "seeds, 8 documents)", "accumulated_sweep5b.json", "so2_learned_qkv+alibi", "so2_learned_qkv", "ratio", 8192, 128,
     "negative"),
    ("accumulated.md", "acc-learned-qkv-rope-64x-5b", "learned Q/K/V rotations degrade less than RoPE at 64x (the 5 "
     "seeds trained again, today's install, 8 documents)", "accumulated_sweep5b.json", "so2_learned_qkv", "rope", "ratio",
     8192, 128, "negative"),
    ("sessa.md", "sessa-ss-curriculum-scratch", "SymbolSoup at 400-600 tokens: the length curriculum more accurate than "
     "an equal-cost run from scratch (Sessa, the project's initialisation)", "sessa_symbolsoup_curriculum.json",
     "sessa_normal", "sessa_scratch", "acc", "all", None, "positive"),
    ("sessa.md", "sessa-ss-curriculum-scratch-transformer", "SymbolSoup at 400-600 tokens: the length curriculum more "
     "accurate than an equal-cost run from scratch (the Transformer, the project's initialisation)",
     "sessa_symbolsoup_curriculum.json", "transformer_normal", "transformer_scratch", "acc", "all", None, "positive"),
    ("sessa.md", "sessa-ss-curriculum-transformer", "SymbolSoup at 400-600 tokens after the length curriculum: Sessa more "
     "accurate than the Transformer", "sessa_symbolsoup_curriculum.json", "sessa_normal", "transformer_normal", "acc",
     "all", None, "positive"),
    ("sessa.md", "sessa-ss-scratch-transformer", "SymbolSoup at 400-600 tokens, equal-cost runs from scratch: Sessa more "
     "accurate than the Transformer", "sessa_symbolsoup_curriculum.json", "sessa_scratch", "transformer_scratch", "acc",
     "all", None, "positive"),
    ("layers.md", "layers-rnope-rope-passkey-16x", "RNoPE-SWA retrieves the passkey more often than RoPE at 16x (the "
     "hybrid paper's lead claim; 5 seeds)", "layers_passkey_seeds.json", "rnope_swa passkey", "rope passkey", "acc", 2048,
     None, "positive"),
    ("layers.md", "layers-rnope-swa-passkey-4x", "RNoPE-SWA retrieves the passkey more often than RoPE in a sliding "
     "window at 4x (its global NoPE layers reach past the window; 5 seeds)", "layers_passkey_seeds.json",
     "rnope_swa passkey", "rope_swa passkey", "acc", 512, None, "positive"),
    ("layers.md", "layers-rnope-rope-train", "RNoPE-SWA: lower perplexity than RoPE at the training length (5 seeds, 4 "
     "documents)", "layers_seeds.json", "rnope_swa", "rope", "ppl", 128, None, "negative"),
    ("layers.md", "layers-rnope-rope-64x", "RNoPE-SWA degrades less than RoPE at 64x (5 seeds, 4 documents)",
     "layers_seeds.json", "rnope_swa", "rope", "ratio", 8192, 128, "negative"),
    ("layers.md", "layers-swa-rope-64x", "RoPE in a sliding window degrades less than RoPE at 64x (5 seeds, 4 documents)",
     "layers_seeds.json", "rope_swa", "rope", "ratio", 8192, 128, "negative"),
    ("layers.md", "layers-local-global-rope-64x", "Gemma-style local/global RoPE degrades less than RoPE at 64x (5 seeds, "
     "4 documents)", "layers_seeds.json", "local_global", "rope", "ratio", 8192, 128, "negative"),
    ("layers.md", "layers-nope-rope-64x", "NoPE degrades less than RoPE at 64x (5 seeds, 4 documents)",
     "layers_seeds.json", "nope", "rope", "ratio", 8192, 128, "negative"),
    ("layers.md", "layers-rnope-swa-64x", "RNoPE-SWA: lower perplexity than RoPE in a sliding window at 64x (5 seeds, 4 "
     "documents)", "layers_seeds.json", "rnope_swa", "rope_swa", "ppl", 8192, None, "negative"),
]


def per_seed(data: dict, arm: str, measure: str, column, train_len) -> dict[int, float]:
    """{seed: the measure} of one arm."""
    rec, columns = data["arms"][arm], [str(c) for c in data["columns"]]
    values = np.array(rec["values"], float)
    at = values[:, columns.index(str(column))]
    if measure == "ratio":
        at = np.log(at / values[:, columns.index(str(train_len))])
    elif measure == "ppl":
        at = np.log(at)
    return dict(zip(rec["seeds"], at.tolist()))


def per_document(data: dict, arm: str, measure: str, column, train_len) -> dict[int, np.ndarray] | None:
    """{seed: the measure per document} of one arm (log perplexity, or log ratio to the training
    length, of each document's own targets), or None where the json has no documents (or the
    measure is an accuracy)."""
    rec, columns = data["arms"][arm], [str(c) for c in data["columns"]]
    if measure == "acc" or "per_document" not in rec:
        return None

    def log_ppl(seed_docs, at):
        docs = np.asarray(seed_docs[columns.index(str(at))], float)  # [document, (summed NLL, targets)]
        return docs[:, 0] / docs[:, 1]

    at = [log_ppl(docs, column) - (log_ppl(docs, train_len) if measure == "ratio" else 0.0)
          for docs in rec["per_document"]]
    return dict(zip(rec["seeds"], at))


def row(claim) -> dict:
    page, name, text, source, a, b, measure, column, train_len, sign = claim
    with open(os.path.join(HERE, source)) as f:
        data = json.load(f)
    x, y = (per_seed(data, arm, measure, column, train_len) for arm in (a, b))
    seeds = sorted(set(x) & set(y))
    interval = paired([x[s] for s in seeds], [y[s] for s in seeds])
    out = {"page": page, "id": name, "claim": text, "source": source, "a": a, "b": b, "measure": measure,
           "column": column, "seeds": seeds, **interval, "verdict": verdict(interval, sign)}
    docs = [per_document(data, arm, measure, column, train_len) for arm in (a, b)]
    if all(d is not None for d in docs):  # each document's difference, averaged over the seeds
        texts = paired(*(np.mean([d[s] for s in seeds], axis=0) for d in docs))
        out["documents"] = {**texts, "verdict": verdict(texts, sign)}
    return out


def shown(value: float, measure: str) -> str:
    if measure == "acc":
        return f"{value:+.3f}"
    return f"{100 * (math.exp(value) - 1):+.1f}%" if math.isfinite(value) else ("-inf" if value < 0 else "+inf")


def ledger() -> str:
    rows = [row(c) for c in CLAIMS]
    lines = [
        "# Claims ledger: comparisons over seeds, with paired 95% intervals",
        "",
        "Generated by `python -m lab.results.claims` from the committed per-seed json; do not edit "
        "(tests/project/test_claims.py fails where this file and the script disagree). A page states each verdict "
        "where it makes the claim as `[claim <id>: <verdict>](claims.md)`, and the test fails where that "
        "verdict is not this file's.",
        "",
        "Each row pairs arm A and arm B seed by seed. `ratio` is how much more A's perplexity grows from "
        "the training length to the column than B's (A's ppl(L)/ppl(train) over B's, minus 1); `ppl` is "
        "A's perplexity over B's at the column, minus 1; `acc` is A's accuracy minus B's. The interval is "
        "Student's t over the seeds' paired differences (of the logs for ratio and ppl). Verdict: "
        "**supported** where the interval lies wholly on the side the page claims, **contradicted** where "
        "wholly on the other, else **not resolved**. With 3 seeds the same sign in every seed happens 25% of "
        "the time with no effect at all; it is shown, not used. `over documents`, where the json holds each "
        "seed's evaluation documents: the same rule with the documents as the sample (each document's A - B "
        "averaged over the seeds, Student's t over the documents), whether the difference holds across the "
        "text scored; '-' where there are none (older tables, accuracies).",
        "",
        "| page | id | claim | A vs B | measure at | seeds | A vs B (mean) | 95% interval | p | same sign in every seed "
        "| verdict | over documents: 95% interval | over documents: verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        d = r.get("documents")
        texts = (f"{d['n']} documents: {shown(d['low'], r['measure'])} to {shown(d['high'], r['measure'])} | "
                 f"{d['verdict']}") if d else "- | -"
        lines.append(
            f"| {r['page']} | {r['id']} | {r['claim']} | {r['a']} vs {r['b']} | {r['measure']} at {r['column']} | "
            f"{', '.join(map(str, r['seeds']))} | {shown(r['mean'], r['measure'])} | "
            f"{shown(r['low'], r['measure'])} to {shown(r['high'], r['measure'])} | {r['p']:.3f} | "
            f"{'yes' if r['same_sign'] else 'no'} | {r['verdict']} | {texts} |")
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("supported", "not resolved", "contradicted")}
    both = [r for r in rows if "documents" in r]
    lines += ["", f"{len(rows)} comparisons: " + ", ".join(f"{n} {v}" for v, n in counts.items()) + ". "
              f"{len(both)} with documents, of which supported over the seeds and over the documents alike: "
              f"{sum(r['verdict'] == r['documents']['verdict'] == 'supported' for r in both)}.", ""]
    return "\n".join(lines + against_papers(rows))


PAPERS = {"accumulated_transformations_extrapolate": "accumulated transformations",
          "espr_equivariant_structured_rotations": "ESPR", "sessa_selective_state_space_attention": "Sessa"}


def papers() -> list[dict]:
    """docs/results/paper_claims.json: per claim id, what the paper reports on that comparison."""
    with open(os.path.join(HERE, "paper_claims.json")) as f:
        return json.load(f)


def agreement(direction: str, ours: str) -> str:
    """Whether our verdict and the paper's result say the same thing."""
    if direction == "none":
        return "no result in the paper to compare"
    if ours == "not resolved":
        return "not settled here"
    return "agrees" if (ours == "supported") == (direction == "same") else "disagrees"


def against_papers(rows: list[dict]) -> list[str]:
    ours = {r["id"]: r["verdict"] for r in rows}
    lines = ["## Against the papers", "",
             "What the paper reports on the same comparison (docs/results/paper_claims.json, which also holds a "
             "verbatim quote to find each by). `direction`: the paper's result against the claim's (same, "
             "opposite, or none where it reports no such comparison). Our settings differ from the papers' "
             "(model sizes, training lengths, extrapolation factors, data): the last column says how where it "
             "matters.", "",
             "| id | paper | where | the paper reports | direction | ours | agreement | setting |",
             "|---|---|---|---|---|---|---|---|"]
    for p in papers():
        lines.append(f"| {p['id']} | {PAPERS.get(p['paper'], p['paper'] or '-')} | {p['where']} | "
                     f"{p['paper_says'] or 'nothing'} | {p['direction']} | {ours[p['id']]} | "
                     f"{agreement(p['direction'], ours[p['id']])} | {p['setting_differs'] or ''} |")
    found = [agreement(p["direction"], ours[p["id"]]) for p in papers()]
    counts = {k: found.count(k) for k in ("agrees", "disagrees", "not settled here", "no result in the paper to compare")}
    return lines + ["", ", ".join(f"{n} {k}" for k, n in counts.items()) + ".", ""]


def main(argv=()) -> None:
    if len(argv) > 1:
        raise SystemExit(f"lab.results.claims takes no arguments; got {' '.join(argv[1:])}")
    with open(os.path.join(HERE, "claims.md"), "w") as f:
        f.write(ledger())
    print(ledger())


if __name__ == "__main__":
    app.run(main)
