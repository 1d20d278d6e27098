"""Metrics for the evaluation studies: LongBench-style task scores, agreement, KL, growth exponents.

Task scores follow LongBench's normalization (lowercase, drop punctuation and the articles
a/an/the, collapse whitespace) and take the best score over the reference answers:

* ``f1``: token-level F1 of prediction vs answer (QA tasks);
* ``rouge_l``: ROUGE-L F-measure from the longest common subsequence of tokens (summarization);
* ``exact_match``: 1.0 when the normalized strings are equal (classification-like tasks).

Torch is imported only by ``kl_divergence``.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from typing import Callable, Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(s: str) -> str:
    """Lowercase, strip punctuation and articles, collapse whitespace (LongBench / SQuAD)."""
    s = s.lower().translate(_PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def f1_score(prediction: str, answer: str) -> float:
    """Token F1 between normalized prediction and answer (0.0 when either is empty)."""
    pred, gold = normalize_answer(prediction).split(), normalize_answer(answer).split()
    same = sum((Counter(pred) & Counter(gold)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def lcs_length(a: Sequence, b: Sequence) -> int:
    """Length of the longest common subsequence of two sequences (O(len(a) * len(b)))."""
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(prediction: str, answer: str) -> float:
    """ROUGE-L F-measure (beta = 1) over normalized tokens."""
    pred, gold = normalize_answer(prediction).split(), normalize_answer(answer).split()
    lcs = lcs_length(pred, gold)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(pred), lcs / len(gold)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, answer: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(answer))


METRICS: dict[str, Callable[[str, str], float]] = {"f1": f1_score, "rouge_l": rouge_l, "exact_match": exact_match}

# LongBench dataset -> metric (their code-similarity and counting tasks are scored here by EM/F1)
TASK_METRICS = {
    "narrativeqa": "f1", "qasper": "f1", "multifieldqa_en": "f1", "hotpotqa": "f1", "2wikimqa": "f1",
    "musique": "f1", "triviaqa": "f1", "gov_report": "rouge_l", "qmsum": "rouge_l", "multi_news": "rouge_l",
    "samsum": "rouge_l", "trec": "exact_match", "lsht": "exact_match", "passage_count": "exact_match",
    "passage_retrieval_en": "exact_match",
}


def metric_for(task: str) -> str:
    """The metric name for a task: LongBench names, else by keyword (sum -> ROUGE-L, class -> EM), else F1."""
    name = task.lower().removesuffix("_e")
    if name in TASK_METRICS:
        return TASK_METRICS[name]
    if any(k in name for k in ("sum", "report", "news")):
        return "rouge_l"
    if any(k in name for k in ("class", "label", "choice", "retriev", "count")):
        return "exact_match"
    return "f1"


def task_score(task: str, prediction: str, answers: Sequence[str]) -> float:
    """Best score of ``prediction`` over ``answers`` with the task's metric. Classification-like
    tasks score the first line of the prediction, as LongBench does for its few-shot tasks."""
    metric = metric_for(task)
    if metric == "exact_match":
        prediction = prediction.lstrip("\n").split("\n")[0]
    fn = METRICS[metric]
    return max((fn(prediction, a) for a in answers), default=0.0)


def token_agreement(a: Sequence[int], b: Sequence[int]) -> float:
    """Fraction of positions equal until the first divergence: common prefix / longer length
    (1.0 for two empty outputs)."""
    longest = max(len(a), len(b))
    if longest == 0:
        return 1.0
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n / longest


def kl_divergence(p_logits, q_logits) -> float:
    """KL(P || Q) in nats between the softmax distributions of two logit vectors [V], in float64."""
    import torch

    logp = torch.log_softmax(p_logits.detach().double().flatten(), -1)
    logq = torch.log_softmax(q_logits.detach().double().flatten(), -1)
    return float((logp.exp() * (logp - logq)).sum().clamp_min(0.0))


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of log(y) against log(x): the growth exponent k of y ~ x**k."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"need two or more (x, y) pairs, got {len(xs)} x and {len(ys)} y")
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    var = sum((x - mx) ** 2 for x in lx)
    if var == 0:
        raise ValueError("all x are equal: no slope")
    return sum((x - mx) * (y - my) for x, y in zip(lx, ly)) / var
