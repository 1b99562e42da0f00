"""megamoe.distributed in one process: row records, padding, the agreement rules, the fused launcher's
argument checks, fingerprints. The spawned-rank tests are in test_distributed_ranks.py."""

from __future__ import annotations

import pytest
import torch

from megamoe.distributed import agreement as agreement_mod
from megamoe.distributed import setup_fingerprint, spawn
from megamoe.distributed.check import fast_random_weights
from megamoe.distributed.comm import FieldSpec, pack_rows, spec_of, unpack_rows
from megamoe.distributed.fused import EPBackend, FusedEPLauncher, ReferenceEPBackend, check_ep_ranks, check_hopper
from megamoe.geometry import get_geometry
from megamoe.inputs import make_inputs, pad_inputs
from megamoe.reference.pipeline import moe_forward
from megamoe.testing import assert_bitwise_equal

SEED = 7103


def _random_bits(n: int, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Arbitrary bit patterns (NaN payloads and -0.0 included) of dtype [n, *shape]."""
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n, *shape[:-1], shape[-1] * size) if shape else (n, size), generator=gen, dtype=torch.int64)
    return raw.to(torch.uint8).view(dtype).reshape(n, *shape)


@pytest.mark.parametrize("n", [0, 1, 37])
def test_pack_rows_roundtrip_bitwise(n):
    gen = torch.Generator().manual_seed(SEED + n)
    fields = [
        _random_bits(n, (256,), torch.float8_e4m3fn, gen),  # staged x codes
        _random_bits(n, (2,), torch.float32, gen),  # x_sf
        _random_bits(n, (3,), torch.int64, gen),  # topk_idx
        _random_bits(n, (2, 4), torch.bfloat16, gen),  # a 2-D per-row field
    ]
    rec = pack_rows(fields)
    assert rec.dtype == torch.uint8 and rec.shape == (n, 256 + 8 + 24 + 16)
    back = unpack_rows(rec, [spec_of(t) for t in fields])
    for i, (a, b) in enumerate(zip(fields, back)):
        assert_bitwise_equal(b, a, f"field {i}")


def test_unpack_rows_names_expected_width():
    rec = torch.zeros(3, 10, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"expected uint8 \[N, 12\], got torch.uint8 \(3, 10\)"):
        unpack_rows(rec, [FieldSpec(torch.float32, (3,))])


def test_pad_inputs_rows_and_outputs():
    """Padding rows are x 0, idx -1, w 0; the first T output rows do not change and the padded rows are 0."""
    g = get_geometry("tiny")
    w = fast_random_weights(g, seed=SEED)
    inp = make_inputs(g, 13, seed=SEED, mask_prob=0.2)
    padded = pad_inputs(inp, 32)
    assert padded.num_tokens == 32
    assert bool((padded.topk_idx[13:] == -1).all()) and bool((padded.topk_weights[13:] == 0).all())
    assert bool((padded.x[13:] == 0).all())
    assert_bitwise_equal(padded.x[:13], inp.x, "x rows")
    y, yp = moe_forward(inp, w, "flashinfer-mxfp4", g), moe_forward(padded, w, "flashinfer-mxfp4", g)
    assert_bitwise_equal(yp[:13], y, "y of the real rows")
    assert bool((yp[13:] == 0).all())
    assert pad_inputs(inp, 13) is inp
    with pytest.raises(ValueError, match="num_tokens must be >= the rank's 13 tokens, got 5"):
        pad_inputs(inp, 5)


@pytest.mark.parametrize("counts", [[0, 1, 37, 256], [0, 0], [5], [3, 3, 3, 4]])
def test_fallback_rules_match_layouts_plans(counts):
    plans = pytest.importorskip("megamoe.layouts.plans")
    assert agreement_mod._agreed_token_count(counts) == plans.agreed_token_count(counts)
    assert agreement_mod._deepgemm_plan_hint(counts) == plans.deepgemm_plan_hint(counts)
    assert agreement_mod._plan_rules()[2] == "megamoe.layouts.plans"


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_check_ep_ranks_accepts_powers_of_two(n):
    check_ep_ranks(n)


@pytest.mark.parametrize("n", [0, 3, 6, 16, -2])
def test_check_ep_ranks_rejects(n):
    with pytest.raises(ValueError, match=rf"power of two in \[1, 8\] \(one NVLink domain\), got {n}"):
        check_ep_ranks(n)


def test_check_hopper():
    check_hopper(capability=(9, 0))
    with pytest.raises(RuntimeError, match=r"SM90 only: expected device capability 9.x, got 8.0"):
        check_hopper(capability=(8, 0))
    with pytest.raises(RuntimeError, match=r"10.0"):
        check_hopper(capability=(10, 0))
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=r"needs a Hopper \(SM90\) GPU: torch.cuda.is_available\(\) is False"):
            check_hopper()


def test_fused_launcher_needs_a_group_and_a_backend():
    g = get_geometry("tiny")
    be = ReferenceEPBackend(g)
    assert isinstance(be, EPBackend)
    if not torch.distributed.is_initialized():
        with pytest.raises(RuntimeError, match="needs an initialised process group"):
            FusedEPLauncher(be, fast_random_weights(g, seed=SEED), g)


def test_setup_fingerprint_names_the_component():
    g = get_geometry("tiny")
    w = fast_random_weights(g, seed=SEED)
    base = setup_fingerprint(g, "flashinfer-mxfp4", w, num_ranks=4)
    assert set(base) == {"geometry", "recipe", "weight shapes", "weight bytes", "num_ranks"}
    w2 = fast_random_weights(g, seed=SEED)
    w2.l2[3, 5, 7] ^= 1  # one bit of one expert
    diff = {k for k, v in setup_fingerprint(g, "flashinfer-mxfp4", w2, num_ranks=4).items() if v[1] != base[k][1]}
    assert diff == {"weight bytes"}
    diff = {k for k, v in setup_fingerprint(g.with_(clamp=7.0), "deepgemm-sm90-fp4", w, num_ranks=4).items()
            if v[1] != base[k][1]}
    assert diff == {"geometry", "recipe"}


def test_spawn_argument_checks():
    with pytest.raises(ValueError, match="nprocs must be a positive int, got 0"):
        spawn(print, 0)
    with pytest.raises(ValueError, match="backend must be 'gloo' or 'nccl', got 'mpi'"):
        spawn(print, 2, backend="mpi")
    if torch.cuda.device_count() < 2:
        with pytest.raises(RuntimeError, match="needs one GPU per rank: nprocs=2"):
            spawn(print, 2, backend="nccl")


def test_check_fused_ranks_rejects_non_power_of_two_before_spawning():
    from megamoe.distributed.check import check_fused_ranks

    with pytest.raises(ValueError, match="power of two in \\[1, 8\\].*got 3"):
        check_fused_ranks(3)


@pytest.mark.gpu
@pytest.mark.dist
@pytest.mark.parametrize("backend", ["flashinfer-mxfp4", "deepgemm-sm90-fp8", "deepgemm-sm90-fp4"])
def test_fused_launcher_one_rank_h200(backend):
    """The fused launcher over a 1-rank NCCL group: the same agreement/padding/launch path as N ranks."""
    from megamoe.distributed.check import check_fused_ranks
    from megamoe.fused.registry import get_backend_class

    ok, why = get_backend_class(backend).availability()
    if not ok:
        pytest.skip(why)
    (rank, t, diff, a), = check_fused_ranks(1, backend, "small", [37], seed=SEED)
    print(f"\n{backend} 1 rank: T={t} calc_diff {diff:.2e} vs reference; agreement {a.seconds * 1e6:.0f} us")
    assert a.counts == (37,) and a.agreed == 37
    assert diff < 1e-3


@pytest.mark.gpu
@pytest.mark.dist
def test_fused_launcher_multi_rank_ragged():
    from megamoe.distributed.check import check_fused_ranks

    n = 1 << (min(torch.cuda.device_count(), 8).bit_length() - 1)
    if n < 2:
        pytest.skip(f"needs >= 2 GPUs, have {torch.cuda.device_count()}")
    rows = check_fused_ranks(n, "flashinfer-mxfp4", "small", None, seed=SEED)
    for rank, t, diff, a in rows:
        assert a.agreed == max(1, max(a.counts)) and diff < 1e-3, (rank, t, diff)


def test_broken_variant_partial_sums_in_the_collective_differ():
    """Why the combine sends per-slot rows back: the textbook allgather_reducescatter reduce-scatters
    each rank's partial [T, H] bf16 sums, which rounds per rank and reorders the slot sum -> not
    bit-identical (needs K >= 3: two bf16 partials add exactly before their one rounding)."""
    from megamoe.recipe import get_recipe
    from megamoe.reference.dispatch import undispatch
    from megamoe.reference.pipeline import combine, moe_forward_ep
    from megamoe.testing import first_mismatch

    g = get_geometry("small")  # K = 4
    w = fast_random_weights(g, seed=SEED)
    t, ranks = 16, 4
    steps = [make_inputs(g, t, seed=SEED)] + [make_inputs(g, 0, seed=SEED + r) for r in range(1, ranks)]
    res = moe_forward_ep(steps, w, "flashinfer-mxfp4", g, keep_stages=True)
    partial = torch.zeros(t, g.hidden, dtype=torch.bfloat16)
    for st in res.ranks:  # rank d's partial combine over its own slots, summed over ranks
        slots, filled = undispatch([st.l2_out], [st.layout], 0, t, g.num_topk)
        partial = partial + combine(slots, filled, get_recipe("flashinfer-mxfp4"))
    assert first_mismatch(partial, res.y[0]), "the partial-sum variant must differ from the slot-ordered combine"
