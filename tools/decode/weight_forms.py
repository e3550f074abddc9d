"""Compressed weight forms of one MatMul, as a decompression subgraph the CPU plugin may fold
into its compressed MatMul: which codes, which zero points, which groups.

A form is named ``{u|i}{4|8}[g{N}][z]``:

  u   unsigned codes with a zero point per group (or per output channel): NNCF's
      asymmetric modes (``u8`` is zctl's INT8, ``u4g128`` its INT4 on the 1B shape);
  i   signed codes and no zero point: NNCF's symmetric modes (``i8`` INT8_SYM, ``i4g32``
      a Q4_0-like form, ``i8g32`` a Q8_0-like one: i8 with an f16 scale per 32);
  z   (after u) unsigned codes with one zero point for the whole weight, the middle of
      the codes' range: symmetric weights stored unsigned;
  gN  a scale (and zero point) per N inputs of each output row; without it, per row.

Scales are f16, as NNCF writes them. Pure data and graph building; no timing here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import openvino as ov
from openvino import opset13 as ops

FORM_PATTERN = re.compile(r"^(?P<kind>[ui])(?P<bits>4|8)(?:g(?P<group>[1-9]\d*))?(?P<z>z?)$")
ZERO_PER_GROUP, ZERO_SHARED, ZERO_NONE = "per-group", "shared", "none"


@dataclass(frozen=True)
class WeightForm:
    """How an [N, K] weight is stored: code bits and signedness, groups, zero points."""

    bits: int
    signed: bool
    group: int | None  # inputs per scale; None: one scale per output row
    zero: str  # ZERO_PER_GROUP, ZERO_SHARED or ZERO_NONE

    @classmethod
    def parse(cls, name: str) -> WeightForm:
        """The form ``name`` says (module docstring); ValueError for any other text."""
        match = FORM_PATTERN.match(name.strip())
        if match is None or (match["kind"] == "i" and match["z"]):
            raise ValueError(f"a weight form is {{u|i}}{{4|8}}[gN][z] (z after u only), e.g. "
                             f"u8, i8g32, u4g128, i4g32, u4g32z; got {name!r}")
        signed = match["kind"] == "i"
        zero = ZERO_NONE if signed else ZERO_SHARED if match["z"] else ZERO_PER_GROUP
        return cls(int(match["bits"]), signed, int(match["group"]) if match["group"] else None,
                   zero)

    @property
    def name(self) -> str:
        """The form's name, as ``parse`` reads it."""
        group = f"g{self.group}" if self.group else ""
        return f"{'i' if self.signed else 'u'}{self.bits}{group}" + \
            ("z" if self.zero == ZERO_SHARED else "")

    @property
    def code_type(self) -> ov.Type:
        """The codes' OpenVINO element type."""
        return {(4, False): ov.Type.u4, (4, True): ov.Type.i4, (8, False): ov.Type.u8,
                (8, True): ov.Type.i8}[(self.bits, self.signed)]

    def code_range(self) -> tuple[int, int]:
        """The smallest and largest code."""
        if self.signed:
            return -(1 << (self.bits - 1)), (1 << (self.bits - 1)) - 1
        return 0, (1 << self.bits) - 1

    def groups(self, k: int) -> int:
        """Scales per output row for ``k`` inputs; ValueError if the group does not divide K."""
        if self.group is None:
            return 1
        if k % self.group:
            raise ValueError(f"K={k} is not a multiple of the group size {self.group}")
        return k // self.group

    def nbytes(self, n: int, k: int) -> int:
        """Bytes a MatMul of an [N, K] weight in this form reads: codes, zero points (per
        group, or one), f16 scales."""
        scales = n * self.groups(k)
        zeros = {ZERO_PER_GROUP: scales, ZERO_SHARED: 1, ZERO_NONE: 0}[self.zero]
        return (n * k + zeros) * self.bits // 8 + scales * 2


@dataclass(frozen=True)
class FormWeight:
    """An [N, K] weight in a ``WeightForm``: codes [N, G, K/G] (grouped) or [N, K], zero
    points (the scales' shape, a scalar, or None) and f16 scales [N, G, 1] or [N, 1]."""

    form: WeightForm
    codes: np.ndarray
    zero: np.ndarray | None
    scale: np.ndarray

    @classmethod
    def random(cls, n: int, k: int, form: WeightForm, rng: np.random.Generator) -> FormWeight:
        """Random codes, zero points and scales of an [N, K] weight in ``form``."""
        groups = form.groups(k)
        shape = (n, groups, k // groups) if form.group else (n, k)
        lead = (n, groups, 1) if form.group else (n, 1)
        low, high = form.code_range()
        dtype = np.int8 if form.signed else np.uint8
        codes = rng.integers(low, high + 1, shape).astype(dtype)
        zero = {ZERO_PER_GROUP: lambda: rng.integers(low, high + 1, lead).astype(dtype),
                ZERO_SHARED: lambda: np.array(1 << (form.bits - 1), dtype),
                ZERO_NONE: lambda: None}[form.zero]()
        scale = (rng.random(lead) * 0.5 / (1 << form.bits)).astype(np.float16)
        return cls(form, codes, zero, scale)

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K)."""
        n = self.codes.shape[0]
        return n, self.codes.size // n

    @property
    def nbytes(self) -> int:
        """Bytes a MatMul reads (WeightForm.nbytes)."""
        return self.form.nbytes(*self.shape)

    def dense(self) -> np.ndarray:
        """The [N, K] f32 weight the graph stands for: (code - zero) * scale in f32."""
        values = self.codes.astype(np.float32)
        if self.zero is not None:
            values = values - self.zero.astype(np.float32)
        return (values * self.scale.astype(np.float32)).reshape(self.shape)

    def node(self) -> ov.Output:
        """The decompression subgraph: Constant codes -> Convert f16 [-> Subtract zero]
        -> Multiply scale [-> Reshape to [N, K]] -> Convert f32 (as NNCF leaves it)."""
        kind = self.form.code_type
        out = ops.convert(ops.constant(self.codes, kind), "f16")
        if self.zero is not None:
            out = ops.subtract(out, ops.convert(ops.constant(self.zero, kind), "f16"))
        out = ops.multiply(out, ops.constant(self.scale))
        if self.form.group:
            out = ops.reshape(out, ops.constant(np.array(self.shape, np.int64)), False)
        return ops.convert(out, "f32").output(0)
