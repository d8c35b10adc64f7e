"""The one reader of dataset folders: random access to samples for the trainer and the evaluator.

Datasets are far larger than memory, so the index is built from each shard's header,
``sample_offsets`` and metadata only, and :meth:`DatasetReader.get` slices one sample's rows
out of the memory-mapped file (decoded to fp32: evaluation); :meth:`DatasetReader.get_stored` leaves them as
stored, for the training loader to decode on the device (``redraft.core.dataset.stored``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from redraft.core.dataset.format import (
    COUNTS_NAME,
    MANIFEST_NAME,
    DatasetError,
    SampleFeatures,
    ShardHeader,
    feature_layout,
    load_manifest,
    non_finite_fields,
    read_shard_header,
    resolve_inside,
    sha256_file,
    teacher_kinds,
)
from redraft.core.dataset.fp8 import decode_hidden
from redraft.core.dataset.stored import StoredSample, stored_problems
from redraft.core.dataset.token_counts import count_tokens


class DatasetReader:
    """Random access to the samples of a finalized dataset folder.

    The index (sample -> shard, row range) is built from shard headers, `sample_offsets`
    and metadata only; `get` reads one sample's rows through memory-mapped slices.
    Picklable (open handles are dropped), so it can go to DataLoader workers.
    """

    _MAX_OPEN = 64

    def __init__(self, root: str | Path, *, verify_checksums: bool = False, manifest: dict | None = None) -> None:
        """``manifest``: read these shards of ``root`` instead of its manifest.json (the streaming trainer's
        window, redraft.core.dataset.window: the dataset header plus ``shards`` entries); token counts then come
        from the shards themselves."""
        self.root = Path(root)
        self._partial = manifest is not None
        self.manifest: dict = load_manifest(self.root) if manifest is None else manifest
        self._paths: list[Path] = []
        self._headers: list[ShardHeader] = []
        self.sample_ids: list[str] = []
        self.sources: list[str] = []
        self.categories: list[str | None] = []
        self.lengths: list[int] = []
        self.num_loss_tokens: list[int] = []
        self.truncated: list[bool] = []
        self._loc: list[tuple[int, int, int]] = []
        mpath = self.root / MANIFEST_NAME
        for si, entry in enumerate(self.manifest["shards"]):
            if not isinstance(entry, dict) or "path" not in entry:
                raise DatasetError(f"{mpath}: shards[{si}] has no 'path'")
            path = resolve_inside(self.root, entry["path"])
            if not path.is_file():
                raise DatasetError(f"{path}: shard file is missing (listed in {mpath})")
            if verify_checksums:
                digest = sha256_file(path)
                if digest != entry.get("sha256"):
                    raise DatasetError(f"{path}: sha256 {digest} != manifest {entry.get('sha256')}")
            hdr = read_shard_header(path)
            for key in ("num_samples", "num_tokens"):
                got = len(hdr.samples) if key == "num_samples" else hdr.num_tokens
                if key in entry and int(entry[key]) != got:
                    raise DatasetError(f"{path}: {key} {got} disagrees with {mpath} ({entry[key]})")
            self._checkfeature_layout(hdr)
            self._paths.append(path)
            self._headers.append(hdr)
            for j, s in enumerate(hdr.samples):
                self.sample_ids.append(str(s["id"]))
                self.sources.append(str(s.get("source", "")))
                self.categories.append(s.get("category"))
                self.lengths.append(int(s["num_tokens"]))
                self.num_loss_tokens.append(int(s.get("num_loss_tokens", 0)))
                self.truncated.append(bool(s.get("truncated", False)))
                self._loc.append((si, hdr.offsets[j], hdr.offsets[j + 1]))
        self._check_totals(mpath)
        self._index: dict[str, int] = {}
        for i, sid in enumerate(self.sample_ids):
            if sid in self._index:
                raise DatasetError(
                    f"{mpath}: sample id {sid!r} appears twice (samples {self._index[sid]} and {i})"
                )
            self._index[sid] = i
        self._open: dict[int, Any] = {}

    def _check_totals(self, mpath: Path) -> None:
        """The manifest totals must equal the sum of its shards (cheap: headers are already parsed)."""
        got = {"num_samples": len(self.sample_ids), "num_tokens": sum(self.lengths),
               "num_loss_tokens": sum(self.num_loss_tokens)}
        for key, value in got.items():
            if key in self.manifest and int(self.manifest[key]) != value:
                raise DatasetError(f"{mpath}: {key} {self.manifest[key]} disagrees with its shards ({value})")

    def _checkfeature_layout(self, hdr: ShardHeader) -> None:
        if not hdr.samples:
            return
        want = int(self.manifest["hidden_size"]) * hdr.num_aux
        if hdr.aux_width != want:
            raise DatasetError(
                f"{hdr.path}: key 'aux_hidden' width {hdr.aux_width} != num_aux {hdr.num_aux} * hidden_size "
                f"{self.manifest['hidden_size']} from the manifest"
            )
        ref = next((h for h in self._headers if h.samples), None)
        if ref is not None and feature_layout(ref) != feature_layout(hdr):
            raise DatasetError(
                f"{hdr.path}: feature keys/widths {feature_layout(hdr)} differ from {ref.path} {feature_layout(ref)}"
            )

    def require_samples(self) -> DatasetReader:
        """This reader, or a DatasetError naming the manifest when the dataset holds no sample (nothing to train or
        evaluate: its extraction skipped every record)."""
        if not len(self):
            skipped = self.manifest.get("skipped") or "none counted"
            raise DatasetError(f"{self.root / MANIFEST_NAME}: the dataset holds no sample (its extraction skipped "
                               f"every record: {skipped})")
        return self

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_open"] = {}
        return state

    def __len__(self) -> int:
        return len(self.sample_ids)

    def index_of(self, sample_id: str) -> int:
        try:
            return self._index[sample_id]
        except KeyError:
            raise KeyError(f"sample id {sample_id!r} is not in {self.root}") from None

    def _handle(self, si: int) -> Any:
        f = self._open.get(si)
        if f is None:
            if len(self._open) >= self._MAX_OPEN:
                self._open.pop(next(iter(self._open)))
            try:
                f = safe_open(str(self._paths[si]), framework="pt")
            except SafetensorError as e:
                raise DatasetError(f"{self._paths[si]}: not a readable safetensors file: {e}") from e
            self._open[si] = f
        return f

    def _locate(self, i: int) -> tuple[int, int, int, ShardHeader, Any]:
        """(index, first row, end row, shard header, open shard) of sample ``i`` (negative counts from the end)."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample index {i} out of range for {len(self)} samples")
        i %= len(self)
        si, a, b = self._loc[i]
        return i, a, b, self._headers[si], self._handle(si)

    def get(self, i: int) -> SampleFeatures:
        """Sample `i` with int64 ids, bool loss mask, float32 hidden states (fp8 dequantised)."""
        i, a, b, hdr, f = self._locate(i)

        def rows(key: str) -> torch.Tensor:
            return f.get_slice(key)[a:b]

        aux = decode_hidden(rows("aux_hidden"), rows("aux_scale") if "aux_scale" in hdr.shapes else None)
        last = None
        if hdr.has_last_hidden:
            last = decode_hidden(
                rows("last_hidden"), rows("last_scale") if "last_scale" in hdr.shapes else None
            )
        sample = SampleFeatures(
            sample_id=self.sample_ids[i],
            source=self.sources[i],
            category=self.categories[i],
            input_ids=rows("input_ids").long(),
            loss_mask=rows("loss_mask").bool(),
            aux_hidden=aux,
            topk_ids=rows("topk_ids").long() if hdr.has_topk else None,
            topk_logprobs=rows("topk_logprobs").float() if hdr.has_topk else None,
            last_hidden=last,
            truncated=self.truncated[i],
        )
        self._check_values(sample, hdr.path, a, b)
        return sample

    def get_stored(self, i: int) -> StoredSample:
        """Sample `i` as stored (no decoding: the training loader decodes on the device), checked on its stored
        bytes for what the writer refuses (``redraft.core.dataset.stored.stored_problems``)."""
        i, a, b, hdr, f = self._locate(i)

        def rows(key: str) -> torch.Tensor | None:
            return f.get_slice(key)[a:b] if key in hdr.shapes else None

        sample = StoredSample(
            sample_id=self.sample_ids[i], input_ids=rows("input_ids"), loss_mask=rows("loss_mask"),
            aux_hidden=rows("aux_hidden"), aux_scale=rows("aux_scale"), topk_ids=rows("topk_ids"),
            topk_logprobs=rows("topk_logprobs"), last_hidden=rows("last_hidden"), last_scale=rows("last_scale"))
        problems = stored_problems(sample, self.vocab_size)
        if problems:
            fix = "--deep " if any(p.startswith("non-finite") for p in problems) else ""
            raise DatasetError(f"{hdr.path}: sample {sample.sample_id!r} (rows {a}..{b}): {'; '.join(problems)}; "
                               f"run python -m extract.verify {fix}on the dataset")
        return sample

    def _check_values(self, s: SampleFeatures, path: Path, a: int, b: int) -> None:
        """Damage the header checks cannot see (flipped data bytes): NaN/Inf, ids outside the vocab.

        The writer refuses both, so either means the file changed after it was written; failing
        here names the file instead of training on it (a NaN loss, or an index error in the embedding).
        """
        where = f"{path}: sample {s.sample_id!r} (rows {a}..{b})"
        vocab = self.vocab_size
        for key, ids in (("input_ids", s.input_ids), ("topk_ids", s.topk_ids)):
            if ids is not None and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
                raise DatasetError(f"{where}: key {key!r} holds ids outside 0..{vocab - 1}; "
                                   "run python -m extract.verify on the dataset")
        bad = non_finite_fields(s)
        if bad:
            raise DatasetError(f"{where}: non-finite values in {', '.join(bad)}; "
                               "run python -m extract.verify --deep on the dataset")

    def __getitem__(self, i: int) -> SampleFeatures:
        return self.get(i)

    def token_counts(self) -> torch.Tensor:
        """int64 [vocab_size] loss-masked token counts (for draft-vocabulary selection)."""
        if self._partial:
            return count_tokens(self._paths, int(self.manifest["vocab_size"]))
        path = self.root / COUNTS_NAME
        if not path.is_file():
            raise DatasetError(f"{path}: token counts file is missing")
        try:
            counts = load_file(str(path))
        except SafetensorError as e:
            raise DatasetError(f"{path}: not a readable safetensors file: {e}") from e
        vocab = int(self.manifest["vocab_size"])
        c = counts.get("counts")
        if c is None:
            raise DatasetError(f"{path}: missing key 'counts'")
        if c.dtype != torch.int64 or tuple(c.shape) != (vocab,):
            raise DatasetError(f"{path}: key 'counts' is {c.dtype} {list(c.shape)}, expected int64 [{vocab}]")
        return c

    def _first_nonempty(self) -> ShardHeader | None:
        return next((h for h in self._headers if h.samples), None)

    @property
    def hidden_size(self) -> int:
        return int(self.manifest["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["vocab_size"])

    @property
    def num_aux(self) -> int:
        if self._headers:
            return self._headers[0].num_aux
        return len(self.manifest.get("aux_layer_ids") or [])

    @property
    def hidden_dtype(self) -> str:
        return str(self.manifest.get("hidden_dtype", ""))

    @property
    def teacher(self) -> dict:
        return dict(self.manifest.get("teacher") or {})

    @property
    def has_topk(self) -> bool:
        h = self._first_nonempty()
        return h.has_topk if h is not None else "topk" in teacher_kinds(self.teacher)

    @property
    def has_last_hidden(self) -> bool:
        h = self._first_nonempty()
        return h.has_last_hidden if h is not None else "last_hidden" in teacher_kinds(self.teacher)

    @property
    def topk(self) -> int | None:
        """K of the stored top-k teacher, or None without one."""
        h = self._first_nonempty()
        if h is not None:
            return h.shapes["topk_ids"][1] if h.has_topk else None
        k = self.teacher.get("topk")
        return int(k) if self.has_topk and k is not None else None
