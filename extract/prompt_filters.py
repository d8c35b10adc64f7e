"""Which prompts the target wrote are worth answering: degenerate-text filters, dedup, eval decontamination.

A small model asked for a user request writes the same few requests many times over, cuts itself off,
loops, or drifts into another language or into template tokens; and a drafter trained on prompts that
are close to the evaluation set reports a gain it would not have on fresh traffic. Every check here is
lexical and runs on the standard library only, so it is the same everywhere the pipeline runs:

- text is *normalised* (NFKC, case-folded, every run of non-alphanumerics one space) and cut into words
  (a CJK character is a word of its own);
- two prompts are *near-duplicates* when the Jaccard similarity of their word n-gram sets (n = 3) is at
  least ``near_duplicate``; candidates come from a MinHash LSH index (64 permutations, bands of 2 rows:
  a pair at Jaccard 0.5 becomes a candidate with probability > 0.9999) and are confirmed exactly;
- a prompt *overlaps the evaluation set* when its normalised text equals an evaluation prompt's, or the
  Jaccard similarity of their n-gram sets reaches ``eval_overlap``, or they share at least
  ``eval_min_shared`` n-grams that make up at least ``eval_overlap`` of the smaller set (one is a
  fragment of, or wraps, the other), or it quotes a short evaluation prompt (4+ words) whole.
  Paraphrases with few words in common are not caught.
"""

from __future__ import annotations

import hashlib
import random
import re
import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

# Why a sampled prompt was dropped, in the order the checks run (the first that applies is counted).
DROP_REASONS = (
    "cut",  # no end-of-turn within the token budget: an unfinished request
    "empty",
    "template_tokens",  # the target wrote special tokens of its template (it left the user turn)
    "too_short",
    "not_text",  # mostly digits, symbols or punctuation
    "not_english",  # --self-language en: another script, or no English function words
    "repetitive",
    "eval_overlap",  # close to a prompt of the evaluation set
    "duplicate",  # the same normalised text as an earlier kept prompt
    "near_duplicate",
)
LANGUAGES = ("en", "any")

# Frequent English function words: a prompt of 8+ words with none of them is not English prose.
_ENGLISH = frozenset(
    "a an the and or but if of to in on at by for with from as is are was were be been being it its this that "
    "these those i you he she we they me my your our their what which who how why when where can could would "
    "should will do does did not no please about into than then there here some any all more most".split()
)
_NON_WORD = re.compile(r"[\W_]+", re.UNICODE)
# Scripts written without spaces between words (kana, CJK ideographs, hangul): each character counts as a word.
_UNSPACED = re.compile("([\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af])")


@dataclass(frozen=True)
class FilterSettings:
    """The thresholds of every check (recorded in the manifest with the recipe)."""

    min_words: int = 3
    max_repeated_ngrams: float = 0.3  # share of a prompt's word 3-grams that repeat an earlier one
    min_letter_share: float = 0.25  # letters among the non-space characters
    language: str = "en"  # "en": Latin script and English function words; "any": no language check
    near_duplicate: float = 0.7  # Jaccard of word 3-grams
    eval_overlap: float = 0.5  # Jaccard, or share of the smaller 3-gram set, against an evaluation prompt
    eval_min_shared: int = 3  # 3-grams two prompts must share before the share of the smaller set counts
    ngram: int = 3

    def __post_init__(self) -> None:
        if self.language not in LANGUAGES:
            raise ValueError(f"language must be one of {LANGUAGES}, got {self.language!r}")
        for name in ("near_duplicate", "eval_overlap", "max_repeated_ngrams", "min_letter_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def normalise(text: str) -> str:
    """NFKC, case-folded, every run of non-alphanumeric characters one space (CJK characters spaced), stripped."""
    text = _UNSPACED.sub(r" \1 ", unicodedata.normalize("NFKC", text).casefold())
    return _NON_WORD.sub(" ", text).strip()


def ngrams(text: str, n: int = 3) -> frozenset[str]:
    """The set of word n-grams of the normalised text (the whole text as one gram when shorter than n)."""
    words = normalise(text).split()
    if len(words) < n:
        return frozenset([" ".join(words)]) if words else frozenset()
    return frozenset(" ".join(words[i : i + n]) for i in range(len(words) - n + 1))


def jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)


def _letter_shares(text: str) -> tuple[float, float]:
    """(letters among non-space characters, Latin letters among letters)."""
    chars = [c for c in text if not c.isspace()]
    letters = [c for c in chars if c.isalpha()]
    if not chars or not letters:
        return 0.0, 0.0
    latin = sum(unicodedata.name(c, "").startswith("LATIN") for c in letters)
    return len(letters) / len(chars), latin / len(letters)


def degenerate_reason(text: str, settings: FilterSettings, special_tokens: Iterable[str] = ()) -> str | None:
    """The first of the single-prompt checks (empty … repetitive) that the text fails, or None."""
    if not text.strip():
        return "empty"
    if any(tok and tok in text for tok in special_tokens):
        return "template_tokens"
    words = normalise(text).split()
    if len(words) < settings.min_words:
        return "too_short"
    letters, latin = _letter_shares(text)
    if letters < settings.min_letter_share:
        return "not_text"
    if settings.language == "en" and (latin < 0.9 or (len(words) >= 8 and not _ENGLISH.intersection(words))):
        return "not_english"
    n = settings.ngram
    grams = [" ".join(words[i : i + n]) for i in range(len(words) - n + 1)]
    if len(grams) >= 4:
        repeated = sum(c - 1 for c in Counter(grams).values())
        if repeated / len(grams) > settings.max_repeated_ngrams:
            return "repetitive"
    return None


class MinHashIndex:
    """Near-duplicate search over n-gram sets: MinHash LSH candidates, confirmed by exact Jaccard."""

    _PRIME = (1 << 61) - 1

    def __init__(self, threshold: float, num_perm: int = 64, band_rows: int = 2, seed: int = 1) -> None:
        if num_perm % band_rows:
            raise ValueError(f"num_perm {num_perm} is not a multiple of band_rows {band_rows}")
        rng = random.Random(seed)
        self.threshold = threshold
        self.band_rows = band_rows
        self.perms = [(rng.randrange(1, self._PRIME), rng.randrange(0, self._PRIME)) for _ in range(num_perm)]
        self.buckets: dict[tuple[int, tuple[int, ...]], list[int]] = {}
        self.sets: list[frozenset[str]] = []

    def _bands(self, grams: frozenset[str]) -> list[tuple[int, tuple[int, ...]]]:
        base = [int.from_bytes(hashlib.blake2b(g.encode(), digest_size=8).digest(), "big") for g in grams]
        sig = [min((a * h + b) % self._PRIME for h in base) for a, b in self.perms]
        r = self.band_rows
        return [(i, tuple(sig[i * r : (i + 1) * r])) for i in range(len(sig) // r)]

    def query(self, grams: frozenset[str]) -> int | None:
        """Index of the first stored set with Jaccard >= threshold to `grams`, or None."""
        if not grams:
            return None
        seen: set[int] = set()
        for band in self._bands(grams):
            for j in self.buckets.get(band, ()):
                if j not in seen:
                    seen.add(j)
                    if jaccard(grams, self.sets[j]) >= self.threshold:
                        return j
        return None

    def add(self, grams: frozenset[str]) -> int:
        key = len(self.sets)
        self.sets.append(grams)
        if grams:
            for band in self._bands(grams):
                self.buckets.setdefault(band, []).append(key)
        return key


class EvalSet:
    """The evaluation prompts a training prompt must not be close to (see the module docstring)."""

    def __init__(self, texts: Sequence[str], settings: FilterSettings) -> None:
        self.settings = settings
        self.texts = [t for t in texts if t.strip()]
        self.norms = [normalise(t) for t in self.texts]
        self.exact = {n: i for i, n in enumerate(self.norms)}
        self.grams = [ngrams(t, settings.ngram) for t in self.texts]
        self.by_gram: dict[str, list[int]] = {}
        for i, grams in enumerate(self.grams):
            for g in grams:
                self.by_gram.setdefault(g, []).append(i)

    def __len__(self) -> int:
        return len(self.texts)

    def match(self, text: str) -> int | None:
        """Index of an evaluation prompt the text is close to, or None."""
        norm = normalise(text)
        hit = self.exact.get(norm)
        if hit is not None:
            return hit
        grams = ngrams(text, self.settings.ngram)
        shared: Counter = Counter(i for g in grams for i in self.by_gram.get(g, ()))
        s = self.settings
        padded = f" {norm} "
        for i, k in sorted(shared.items(), key=lambda kv: (-kv[1], kv[0])):
            other = self.grams[i]
            if k / len(grams | other) >= s.eval_overlap:
                return i
            if k >= s.eval_min_shared and k / min(len(grams), len(other)) >= s.eval_overlap:
                return i
            if len(other) >= 2 and f" {self.norms[i]} " in padded:  # a short one (4+ words) quoted whole
                return i
        return None


@dataclass
class Verdict:
    """What the filters decided about one sampled prompt."""

    keep: bool
    reason: str | None = None  # one of DROP_REASONS when dropped
    match: str | None = None  # the evaluation prompt or earlier prompt it is close to


class PromptFilter:
    """Runs the checks on prompts in sampling order; a kept prompt joins the dedup index.

    Stateful on purpose: "duplicate" means "of an earlier kept prompt", so the survivors of a run are
    a pure function of the samples and their order, whatever the batching that produced them.
    """

    def __init__(self, settings: FilterSettings, eval_set: EvalSet | None = None,
                 special_tokens: Iterable[str] = ()) -> None:
        self.settings = settings
        self.eval_set = eval_set
        self.special_tokens = tuple(t for t in special_tokens if t)
        self.exact: dict[str, int] = {}
        self.index = MinHashIndex(settings.near_duplicate)
        self.kept: list[str] = []
        self.counts: Counter = Counter()

    def check(self, text: str, *, finished: bool = True) -> Verdict:
        """Decide on one prompt (`finished`: it ended with an end-of-turn id) and count the decision."""
        verdict = self._decide(text, finished)
        self.counts["kept" if verdict.keep else verdict.reason] += 1
        return verdict

    def _decide(self, text: str, finished: bool) -> Verdict:
        if not finished:
            return Verdict(False, "cut")
        reason = degenerate_reason(text, self.settings, self.special_tokens)
        if reason is not None:
            return Verdict(False, reason)
        if self.eval_set is not None:
            hit = self.eval_set.match(text)
            if hit is not None:
                return Verdict(False, "eval_overlap", self.eval_set.texts[hit])
        key = normalise(text)
        if key in self.exact:
            return Verdict(False, "duplicate", self.kept[self.exact[key]])
        grams = ngrams(text, self.settings.ngram)
        near = self.index.query(grams)
        if near is not None:
            return Verdict(False, "near_duplicate", self.kept[near])
        self.exact[key] = self.index.add(grams)
        self.kept.append(text)
        return Verdict(True)
