"""Serving LoRA adapters from slots: the batched kernel (kernels/lora.py) against its float32 reference in Triton's
interpreter (on the GPU when there is one), the tiles that hand it rows, the scheduler's limit on distinct adapters
(and its fairness), and whole engines serving adapters from slots against the eager forward hooks (the reference
path): one and eight adapters, adapters evicted from their slots between steps. On the GPU the same through the
CUDA graphs (decode, prefill and mixed steps), within bf16 tolerance."""
import numpy as np
import pytest
import torch
from test_decode import scratch_at_zero
from test_engine import GREEDY, assert_no_leaks, make_llm
from tiny_models import make_tiny_model

from kernels.lora import lora_add_, lora_add_ref, lora_shrink, lora_tiles, max_tiles, slot_rank
from service.engine.llm import LLM
from service.engine.scheduler import Scheduler
from service.engine.sequence import Sequence
from service.model.layers import silu_mul_ref
from service.model.lora import Adapter, LoRAConfig, add_adapter
from service.protocol import SamplingParams
from tests.helpers import random_slots, rel_err


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


# -- the kernel and its tiles --------------------------------------------------------------------------------------
def test_tiles_hold_every_adapter_row_once_in_a_tile_of_its_slot():
    rng = np.random.default_rng(0)
    for rows, slots in [(1, 1), (37, 4), (300, 8), (16, 2)]:
        row_slots = rng.integers(-1, slots, size=rows).astype(np.int32)
        tiles = lora_tiles(row_slots, max_tiles(rows, slots))
        seen = []
        for tile in tiles:
            members = tile[1:][tile[1:] >= 0]
            assert (tile[0] < 0) == (len(members) == 0)
            assert (row_slots[members] == tile[0]).all()
            seen += members.tolist()
        assert sorted(seen) == np.flatnonzero(row_slots >= 0).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,k,widths,slots,rank", [(1, 64, (64,), 1, 4), (37, 96, (150, 40, 40), 4, 16),
                                                      (130, 200, (333, 70), 8, 40), (20, 2100, (48,), 2, 16)])
def test_kernel_matches_the_float32_reference(device, dtype, rows, k, widths, slots, rank):
    """Up to three projections of one input, each output a column slice of one wider tensor (as a fused
    projection's), adapters of rank `rank` zero-padded to the slots' rank, rows with no adapter untouched; a K
    longer than kernels.lora.K_SPLIT shrinks in several programs."""
    r = slot_rank(rank)
    x = torch.randn(rows, k, dtype=dtype, device=device)
    wide = torch.randn(rows, sum(widths) + 24, dtype=dtype, device=device)
    weights = torch.zeros(slots, sum(r * (k + n) for n in widths) + 8, dtype=dtype, device=device)
    outputs, col, at = [], 8, 8
    for n in widths:
        weights[:, at:at + r * k].view(slots, r, k)[:, :rank].normal_(0, 0.2)
        weights[:, at + r * k:at + r * (k + n)].view(slots, n, r)[:, :, :rank].normal_(0, 0.2)
        outputs.append((wide[:, col:col + n], at, at + r * k))
        col, at = col + n, at + r * (k + n)
    scales = torch.rand(slots, device=device) + 0.5
    row_slots = torch.randint(-1, slots, (rows,))
    row_slots[0] = slots - 1  # at least one row has an adapter
    tiles = torch.from_numpy(lora_tiles(row_slots.numpy().astype(np.int32), max_tiles(rows, slots))).to(device)
    expected = wide.clone()
    lora_add_ref(x, [(expected[:, c:c + y.shape[1]], a, b) for (y, a, b), c in
                     zip(outputs, np.cumsum([8, *widths[:-1]]))], weights, scales, row_slots.to(device), r)
    before = wide.clone()
    lora_add_(x, outputs, weights, scales, tiles, r)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(wide.float(), expected.float(), atol=tol, rtol=tol)
    untouched = (row_slots < 0).to(device)
    assert torch.equal(wide[untouched], before[untouched])
    assert not torch.equal(wide[~untouched], before[~untouched])


def columns_weight(w: torch.Tensor, weights, parts, rank: int) -> torch.Tensor:
    """kernels.lora's columns layout, built plainly: w [N, K] and beside it, for projection p (the rows of parts[p])
    and slot s, B_s at columns K + (p * slots + s) * rank."""
    slots, (n, k) = weights.shape[0], w.shape
    wide = torch.zeros(n, k + len(parts) * slots * rank, dtype=w.dtype, device=w.device)
    wide[:, :k] = w
    row = 0
    for p, (width, _, b_at) in enumerate(parts):
        for s in range(slots):
            col = k + (p * slots + s) * rank
            wide[row:row + width, col:col + rank] = weights[s, b_at:b_at + width * rank].view(width, rank)
        row += width
    return wide


def assert_columns(t, h, weights, scales, parts, row_slots, rank, tol):
    """t = [h | shrinks] in the columns layout: each row's scaled shrinks in its slot's columns, zeros elsewhere."""
    slots, k = weights.shape[0], h.shape[1]
    assert torch.equal(t[:, :k], h)
    for row, slot in enumerate(row_slots.tolist()):
        for p, (_, a_at, _) in enumerate(parts):
            for s in range(slots):
                got = t[row, k + (p * slots + s) * rank:k + (p * slots + s + 1) * rank]
                if s != slot:
                    assert not got.any(), (row, p, s)
                    continue
                a = weights[s, a_at:a_at + rank * k].view(rank, k).float()
                want = (h[row].float() @ a.t() * scales[s]).to(h.dtype)
                torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("rows,slots,widths,add,columns,chunk_elements", [
    (1, 1, (64, 32, 32), False, False, 8192), (13, 3, (48, 48), True, False, 8192),
    (37, 8, (64, 32, 32), True, False, 8192), (37, 8, (48, 48), False, False, 8192),
    (37, 8, (64, 32, 32), True, True, 8192), (21, 3, (48, 48), False, True, 8192),
    (37, 8, (64, 32, 32), True, True, 1024), (13, 3, (48, 48), False, False, 1024)])
def test_a_norm_computes_the_shrinks_of_the_projections_that_read_it(device, rows, slots, widths, add, columns,
                                                                      chunk_elements, monkeypatch):
    """kernels.elementwise's norms with `shrinks`: the normalized rows as without, and each adapter row's scaled
    shrinks x A^T of its slot rounded as lora_add_ref rounds them; the projections' kernels take them (decode_linear
    up to its rows, lora_add_'s expand past them) and give what their reference gives. columns: the shrinks beside
    the rows in kernels.lora's columns layout, and one matmul with the slots' B beside the weight adds them.
    chunk_elements: at K 200 (256 rounded), 8192 puts a projection's 16 ranks in one program, 1024 in four of four
    ranks each, as the real sizes split them (K 896: 8 ranks a program)."""
    import kernels.lora
    from kernels.decode_linear import MAX_ROWS, decode_linear, decode_linear_ref
    from kernels.elementwise import add_rms_norm_, add_rms_norm_shrinks, rms_norm, rms_norm_shrinks

    monkeypatch.setattr(kernels.lora, "SHRINK_CHUNK_ELEMENTS", chunk_elements)
    k, r = 200, 16
    for dtype in ([torch.bfloat16, torch.float16] if device == "cuda" else [torch.float32, torch.float16]):
        gen = torch.Generator().manual_seed(rows + slots)
        weights, scales, parts = random_slots(widths, k, slots, r, device, dtype, gen)
        x, residual = (torch.randn(rows, k, generator=gen).to(device, dtype) for _ in range(2))
        norm_weight = torch.randn(k, generator=gen).to(device, dtype)
        row_slots = np.arange(rows, dtype=np.int32) % slots
        row_slots[rows // 2] = -1 if rows > 1 else row_slots[0]
        tiles = torch.from_numpy(lora_tiles(row_slots, max_tiles(rows, slots))).to(device)
        shrinks = (weights, scales, tiles, r, [a for _, a, _ in parts])
        if add:
            total = residual.clone()
            plain = add_rms_norm_(x, total, norm_weight, 1e-6)
            before = residual.clone()
            h, new_residual, t = add_rms_norm_shrinks(x, residual, norm_weight, 1e-6, shrinks, columns=columns)
            assert torch.equal(new_residual, total) and torch.equal(residual, before)
        else:
            plain = rms_norm(x, norm_weight, 1e-6)
            h, t = rms_norm_shrinks(x, norm_weight, 1e-6, shrinks, columns=columns)
        assert torch.equal(h, plain)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        w = (torch.randn(sum(widths), k, generator=gen) / k ** 0.5).to(device, dtype)
        silu = len(widths) == 2
        device_slots = torch.from_numpy(row_slots).to(device)
        ref = decode_linear_ref(h, w, silu_mul=silu, lora=(weights, scales, tiles, r, parts), row_slots=device_slots)
        if columns:
            assert_columns(t, h, weights, scales, parts, row_slots, r, tol)
            y = (t.float() @ columns_weight(w, weights, parts, r).float().t()).to(dtype)
            if silu:
                y = silu_mul_ref(*y.float().chunk(2, dim=1)).to(dtype)
            assert rel_err(y, ref) < tol
            continue
        for row in np.flatnonzero(row_slots >= 0):
            s = int(row_slots[row])
            for p, (_, a_at, _) in enumerate(parts):
                a = weights[s, a_at:a_at + r * k].view(r, k).float()
                want = (h[row].float() @ a.t() * scales[s]).to(dtype)
                torch.testing.assert_close(t[row, p * r:(p + 1) * r].float(), want.float(), atol=tol, rtol=tol)
        if rows <= MAX_ROWS:
            got = decode_linear(h, w, silu_mul=silu, lora=(weights, scales, tiles, r, parts), shrunk=t)
            assert rel_err(got, ref) < tol
        if not silu:
            y, want = h @ w.t(), h @ w.t()
            outputs = [(y[:, c - n:c], a, b) for (n, a, b), c in zip(parts, np.cumsum(widths))]
            lora_add_(h, outputs, weights, scales, tiles, r, shrunk=t)
            lora_add_ref(h, [(want[:, c - n:c], a, b) for (n, a, b), c in zip(parts, np.cumsum(widths))], weights,
                         scales, device_slots, r)
            assert rel_err(y, want) < tol and rel_err(y, h @ w.t()) > 10 * tol


@pytest.mark.parametrize("rows,slots,splits,columns", [(1, 1, 1, False), (13, 3, 4, False), (37, 8, 1, True),
                                                     (21, 3, 2, True)])
def test_the_residual_add_adds_the_lora_update_of_the_projection_it_reads(device, rows, slots, splits, columns):
    """add_rms_norm_shrinks' `update`, as the add after o takes it: x, o's output (whole, or float32 partial sums
    over ranges of o's K as decode_linear writes them), gets each adapter row's update of o from o's input u (a
    view, K not a power of two) before the residual add; the result, the new residual and the next projections'
    shrinks are then those of x with the update added by lora_add_ref, and rows of no slot are those without."""
    from kernels.elementwise import add_rms_norm_shrinks

    k, k_u, r = 200, 72, 16
    for dtype in ([torch.bfloat16, torch.float16] if device == "cuda" else [torch.float32, torch.float16]):
        gen = torch.Generator().manual_seed(rows + splits)
        weights, scales, parts = random_slots((48, 48), k, slots, r, device, dtype, gen)
        o_weights, _, ((_, a_o, b_o),) = random_slots((k,), k_u, slots, r, device, dtype, gen)
        a_o, b_o = a_o + weights.shape[1], b_o + weights.shape[1]  # o's pair after gate's and up's in each slot
        weights = torch.cat([weights, o_weights], dim=1)
        x = torch.randn(splits, rows, k, generator=gen).to(device, torch.float32 if splits > 1 else dtype)
        u = torch.randn(rows, k_u + 5, generator=gen).to(device, dtype)[:, :k_u]
        residual, norm_weight = torch.randn(rows, k, generator=gen).to(device, dtype), torch.randn(k).to(device, dtype)
        row_slots = np.arange(rows, dtype=np.int32) % slots
        row_slots[rows // 2] = -1 if rows > 1 else row_slots[0]
        tiles = torch.from_numpy(lora_tiles(row_slots, max_tiles(rows, slots))).to(device)
        shrinks = (weights, scales, tiles, r, [a for _, a, _ in parts])
        summed = x[0].float()
        for s in range(1, splits):  # in the kernel's order: rows of no slot compare exactly
            summed = summed + x[s].float()
        y = summed.to(dtype, copy=True)
        base = add_rms_norm_shrinks(y.clone(), residual, norm_weight, 1e-6, shrinks, columns)
        lora_add_ref(u, [(y, a_o, b_o)], weights, scales, torch.from_numpy(row_slots).to(device), r)
        want = add_rms_norm_shrinks(y, residual, norm_weight, 1e-6, shrinks, columns)
        got = add_rms_norm_shrinks(x if splits > 1 else x[0], residual, norm_weight, 1e-6, shrinks, columns,
                                   update=(u, a_o, b_o))
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        plain = torch.from_numpy(row_slots < 0).to(device)
        for g, w, b in zip(got, want, base) if columns else zip(got[:2], want[:2], base[:2]):
            assert rel_err(g, w) < tol and torch.equal(g[plain], b[plain])
        if not columns:  # the compact shrinks: rows of no slot are left unset
            assert rel_err(got[2][~plain], want[2][~plain]) < tol
        assert rel_err(got[1], base[1]) > 10 * tol  # the update is there


@pytest.mark.parametrize("seqlens,heads,heads_k,head_dim,splits,slots", [
    ([1, 37, 300], 4, 2, 16, 3, 2), ([50, 0, 7, 129, 64] * 4, 6, 2, 16, 2, 8), ([260, 33], 4, 4, 24, 5, 1)])
def test_the_decode_merge_computes_os_shrinks_beside_the_output(device, seqlens, heads, heads_k, head_dim, splits,
                                                                 slots):
    """kernels.decode.decode_attention_shrinks: the attention's output as flash_attn_with_kvcache gives it, in the
    first heads * d columns, and beside it o's shrinks in the columns layout (as lora_shrink writes them from that
    output: each adapter row's in its slot's columns, zeros elsewhere and in every column of a row of no slot),
    for sequences of no keys too and a head_dim * heads that is not a power of two."""
    from kernels.decode import decode_attention_shrinks, flash_attn_with_kvcache
    from tests.test_decode import make_paged

    r, batch = 16, len(seqlens)
    for dtype in ([torch.bfloat16, torch.float16] if device == "cuda" else [torch.float32, torch.float16]):
        gen = torch.Generator().manual_seed(batch + splits)
        q, k_cache, v_cache, lens, table = make_paged(batch, seqlens, 16, heads, heads_k, head_dim, 1, dtype, device)
        weights, scales, parts = random_slots((96,), heads * head_dim, slots, r, device, dtype, gen)
        row_slots = np.where(np.arange(batch) % 3 == 1, -1, np.arange(batch) % slots).astype(np.int32)
        tiles = torch.from_numpy(lora_tiles(row_slots, max_tiles(batch, slots))).to(device)
        out = flash_attn_with_kvcache(q, k_cache, v_cache, lens, table, num_splits=splits).view(batch, -1)
        t = decode_attention_shrinks(q.squeeze(1), k_cache, v_cache, lens, table, None, splits,
                                     (weights, scales, tiles, r, [parts[0][1]]))
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert t.shape == (batch, heads * head_dim + slots * r)
        torch.testing.assert_close(t[:, :heads * head_dim].float(), out.float(), atol=tol, rtol=tol)
        assert_columns(t, t[:, :heads * head_dim], weights, scales, parts, row_slots, r, tol)
        assert t[:, heads * head_dim:].abs().sum() > 0  # some row has shrinks


@pytest.mark.parametrize("rows,k,widths,slots,silu", [(23, 200, (96,), 4, False), (40, 300, (64, 32, 32), 8, False),
                                                      (17, 96, (48,), 1, False), (20, 1100, (32,), 2, False),
                                                      (23, 200, (96,), 4, True), (20, 2100, (32,), 2, True),
                                                      (70, 1100, (32,), 2, True)])
@pytest.mark.parametrize("tiled", [False, True])
def test_lora_shrink_writes_the_input_and_its_shrinks_in_the_columns_layout(device, rows, k, widths, slots, silu,
                                                                            tiled, monkeypatch):
    """lora_shrink(columns=True), as o and down take it past decode_linear's rows: x copied beside its shrinks,
    rows of no slot (a third of them) with zeros. silu: the input is silu(gate) * up of two column slices of one
    tensor (down's, from the fused gate-up output), computed in the same launch. tiled: from tiles of one slot's
    rows (kernels.lora.TILE_SHRINK_MIN_ROWS), several a slot past 16 rows, K in chunks whose sums the last to
    arrive takes, leaving them and the counters at zero for the next launch (the dtypes' two in a row); and
    columns_shrinks_, the same shrinks into a tensor whose first K columns hold the input already (NaN elsewhere)."""
    from kernels import lora

    monkeypatch.setattr(lora, "TILE_SHRINK_MIN_ROWS", 1 if tiled else 0)
    r = 16
    for dtype in ([torch.bfloat16, torch.float16] if device == "cuda" else [torch.float32, torch.float16]):
        gen = torch.Generator().manual_seed(rows + k)
        weights, scales, parts = random_slots(widths, k, slots, r, device, dtype, gen)
        x = torch.randn(rows, k + 7, generator=gen).to(device, dtype)[:, :k]  # a view, as attention's output may be
        up = None
        if silu:
            gate_up = torch.randn(rows, 2 * k, generator=gen).to(device, dtype)
            x, up = gate_up[:, :k], gate_up[:, k:]
        row_slots = np.where(np.arange(rows) % 3 == 1, -1, np.arange(rows) % slots).astype(np.int32)
        tiles = torch.from_numpy(lora_tiles(row_slots, max_tiles(rows, slots))).to(device)
        t = lora_shrink(x, weights, scales, tiles, r, [a for _, a, _ in parts], max_tiles(rows, slots), columns=True,
                        up=up)
        assert t.shape == (rows, k + len(widths) * slots * r)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        if silu:  # within rounding of the reference (its sigmoid is not Triton's), and the shrinks of what it wrote
            torch.testing.assert_close(t[:, :k], silu_mul_ref(x.float(), up.float()).to(dtype), atol=tol, rtol=tol)
        assert_columns(t, t[:, :k] if silu else x, weights, scales, parts, row_slots, r, tol)
        if tiled:
            assert scratch_at_zero("lora_tile_sums")
            given = torch.full_like(t, float("nan"))
            given[:, :k] = t[:, :k]
            lora.columns_shrinks_(given, k, weights, scales, tiles, r, [a for _, a, _ in parts],
                                  max_tiles(rows, slots))
            assert_columns(given, t[:, :k], weights, scales, parts, row_slots, r, tol)


# -- the scheduler ---------------------------------------------------------------------------------------------------
def test_at_most_max_loras_adapters_run_and_a_waiting_one_is_not_starved():
    scheduler = Scheduler(num_blocks=64, block_size=16, enable_prefix_caching=False, max_num_seqs=16,
                          max_num_batched_tokens=256, max_model_len=64, max_loras=2)
    params = SamplingParams(max_new_tokens=4)

    def add(rid, adapter):
        scheduler.add(Sequence(rid, [1, 2, 3], params, adapter=adapter, group=rid))

    add("a0", "A"), add("b0", "B"), add("c0", "C"), add("a1", "A"), add("base", None)
    batch = scheduler.schedule()
    assert {s.request_id for s in batch.seqs} == {"a0", "b0", "base"}  # C waits; A's later request waits behind it
    for seq in list(scheduler.running):
        if seq.adapter == "A":
            scheduler.free(seq)
    batch = scheduler.schedule()
    assert "c0" in {s.request_id for s in batch.seqs} and "a1" not in {s.request_id for s in scheduler.running}
    assert {s.adapter for s in scheduler.running if s.adapter} == {"B", "C"}


# -- engines: slots against the eager hooks ------------------------------------------------------------------------
def adapters_for(model, count: int, rank: int = 4, std: float = 0.3) -> dict[str, Adapter]:
    """Random adapters; std: of B's entries (0.3 changes outputs a lot; 0.02 is the size trained ones have)."""
    adapters = {}
    for i in range(count):
        adapter = Adapter.init(model, LoRAConfig(rank=rank, alpha=2.0 * rank), seed=i)
        for name, (a, b) in adapter.weights.items():
            b.data.normal_(0, std)
        adapters[f"tuned-{i}"] = adapter
    return adapters


def serve(llm: LLM, requests: list[tuple[str, list[int], str | None]], params=GREEDY) -> dict[str, list[int]]:
    engine = llm.engine
    for rid, prompt, adapter in requests:
        engine.add_request(rid, prompt, params, adapter=adapter)
    tokens = {rid: [] for rid, _, _ in requests}
    while engine.has_work:
        for out in engine.step()[0]:
            assert out.error is None, out.error
            tokens[out.request_id].append(out.token_id)
    assert_no_leaks(llm)
    return tokens


@pytest.mark.parametrize("rows,norm_rows,tile_rows", [(17, 64, 0), (64, 64, 0), (100, 64, 0), (100, 256, 0),
                                                    (100, 64, 65), (40, 16, 17)])
def test_gemms_of_a_few_dozen_rows_add_the_updates_from_the_slots_columns(model_dir, device, rows, norm_rows,
                                                                          tile_rows, monkeypatch):
    """Past decode_linear's rows and up to kernels.lora.COLUMNS_MAX_ROWS, a fused projection group's GEMM adds its
    rows' updates from the slots' B beside its weight (service.model.lora.slot_columns; on the CPU with the kernels
    in Triton's interpreter): what the GEMM then lora_add_ (lora_add_ref on the CPU) give, for q/k/v and gate-up
    (shrinks from their norm) and o and down (from lora_shrink), with an adapter loaded into the slot of one
    evicted after the columns were laid out, the projections fused again after, and rows of no adapter. Past the
    norms' rows (100, with the columns' bound raised) every group takes its shrinks from lora_shrink; with the norms'
    bound at `norm_rows` 256 (benchmarks/lora.py's variant) q/k/v and gate-up take them from their norm. From
    `tile_rows` rows (kernels.lora.TILE_SHRINK_MIN_ROWS) past the norms' bound: the norms and the SwiGLU gate write
    into the columns and a launch after each adds the shrinks from tiles; o's lora_shrink takes them from tiles."""
    from torch.nn import functional as F

    from kernels import lora
    from service.model.layers import fused_projection
    from service.model.loader import load_model
    from service.model.lora import LoRASlots, add_slot_updates, serving_slots, slot_columns, slot_shrinks

    monkeypatch.setattr(lora, "COLUMNS_MAX_ROWS", max(rows, lora.COLUMNS_MAX_ROWS))
    monkeypatch.setattr(lora, "ROW_SHRINK_MAX_ROWS", norm_rows)
    monkeypatch.setattr(lora, "TILE_SHRINK_MIN_ROWS", tile_rows)
    normed = rows <= norm_rows or 0 < tile_rows <= rows

    dtype, tol = (torch.bfloat16, 2e-2) if device == "cuda" else (torch.float32, 1e-5)
    model = load_model(model_dir, dtype, device)
    model.fuse_projections()  # (on the CPU: the loader fuses on CUDA only)
    slots = LoRASlots(model, 2, 8)
    for name, adapter in adapters_for(model, 3).items():
        add_adapter(model, name, adapter.to(device, dtype))
    for names in ({"tuned-0", "tuned-1"}, {"tuned-1", "tuned-2"}):  # tuned-2 takes tuned-0's slot
        slot_of, loads = slots.assign(names)
        for slot, name in loads:
            slots.load(slot, name)
    assert slots.evictions == 1
    model.fuse_projections(False)  # and back, as benchmarks/step_profile.py switches paths: the columns stay
    model.fuse_projections()
    g = torch.Generator().manual_seed(rows)
    row_slots = torch.tensor([-1, *slot_of.values()])[torch.randint(0, 3, (rows,), generator=g)].to(torch.int32)
    tiles = torch.from_numpy(lora_tiles(row_slots.numpy(), max_tiles(rows, 2))).to(device)
    layer = model.model.layers[1]
    attn, mlp = layer.self_attn, layer.mlp

    def check(linears, weight, bias, x, silu=False, norm=None):
        assert slot_columns(linears, rows, norm is not None and normed) is not None
        assert slot_columns(linears, 16, norm is not None) is None
        shrunk = None
        if norm is not None:  # the norm computes the input, and its shrinks up to ROW_SHRINK_MAX_ROWS
            x, _, shrunk = norm.add(None, x, True, slot_shrinks(rows, *linears))
            assert (shrunk is not None) == normed
            assert not normed or shrunk.shape[1] == x.shape[1] + len(linears) * 2 * slots.rank
        got = fused_projection(x, weight, bias, linears, silu=silu, shrunk=shrunk)
        want = F.linear(x, weight, bias)
        parts = want.split([linear.out_features for linear in linears], dim=1)
        base = silu_mul_ref(*parts) if silu else want.clone()
        add_slot_updates(x, *zip(linears, parts))
        want = silu_mul_ref(*parts) if silu else want
        assert rel_err(got, want) < tol and rel_err(got, base) > 10 * tol

    def randn(cols):
        return torch.randn(rows, cols, generator=g).to(device, dtype)

    with torch.no_grad(), serving_slots(slots, tiles, row_slots.to(device)):
        hidden = model.config.hidden_size
        check((attn.q_proj, attn.k_proj, attn.v_proj), attn.qkv_weight, attn.qkv_bias, randn(hidden),
              norm=layer.input_layernorm)
        check((attn.o_proj,), attn.o_proj.weight, None, randn(attn.o_proj.in_features))
        check((mlp.gate_proj, mlp.up_proj), mlp.gate_up_weight, None, randn(hidden), silu=True,
              norm=layer.post_attention_layernorm)
        check((mlp.down_proj,), mlp.down_proj.weight, None, randn(mlp.down_proj.in_features))
        # The whole MLP: down's shrinks come from the launch that computes the SwiGLU gate
        x, _, shrunk = layer.post_attention_layernorm.add(None, randn(hidden), True,
                                                          slot_shrinks(rows, mlp.gate_proj, mlp.up_proj))
        got = mlp._forward_fused(x, shrunk)
        gate, up = F.linear(x, mlp.gate_proj.weight), F.linear(x, mlp.up_proj.weight)
        base = F.linear(silu_mul_ref(gate, up), mlp.down_proj.weight)
        add_slot_updates(x, (mlp.gate_proj, gate), (mlp.up_proj, up))
        h = silu_mul_ref(gate, up)
        want = F.linear(h, mlp.down_proj.weight)
        add_slot_updates(h, (mlp.down_proj, want))
        assert rel_err(got, want) < tol and rel_err(got, base) > 10 * tol


@pytest.mark.parametrize("count,max_loras", [(1, 8), (8, 8), (5, 2)])  # (5, 2): adapters take turns in 2 slots
def test_adapters_from_slots_give_what_the_eager_hooks_give(model_dir, count, max_loras):
    slotted, eager = make_llm(model_dir, max_loras=max_loras), make_llm(model_dir, max_loras=0)
    assert slotted.engine.runner.slots is not None and eager.engine.runner.slots is None
    for name, adapter in adapters_for(slotted.engine.model, count).items():
        for llm in (slotted, eager):
            add_adapter(llm.engine.model, name, adapter.to("cpu", torch.float32))
    g = torch.Generator().manual_seed(0)
    requests = [(f"r{i}", torch.randint(3, 200, (int(torch.randint(5, 40, (1,), generator=g)),),
                                        generator=g).tolist(), None if i % 3 == 2 else f"tuned-{i % count}")
                for i in range(12)]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    got, want = serve(slotted, requests, params), serve(eager, requests, params)
    assert got == want
    base = serve(eager, [(rid + "-base", prompt, None) for rid, prompt, _ in requests], params)
    assert any(got[rid] != base[rid + "-base"] for rid, _, adapter in requests if adapter)  # the adapters act
    slots = slotted.engine.runner.slots
    used = {adapter for _, _, adapter in requests if adapter}
    assert slots.loads >= len(used) and (slots.evictions > 0) == (len(used) > max_loras)  # adapters took turns


def test_speculative_verifies_with_adapters_from_slots(model_dir):
    """n-gram drafts for requests on adapters in slots: a verify's rows run as decode rows (the runner's doc), each
    with its sequence's slot; the tokens are those of plain decoding through the eager hooks."""
    spec = make_llm(model_dir, speculative_method="ngram", num_speculative_tokens=3, speculative_min_acceptance=0.0)
    eager = make_llm(model_dir, max_loras=0)
    for name, adapter in adapters_for(spec.engine.model, 2).items():
        for llm in (spec, eager):
            add_adapter(llm.engine.model, name, adapter.to("cpu", torch.float32))
    requests = [(f"r{i}", [5 + i, 6, 7, 8, 9] * 6, None if i == 2 else f"tuned-{i % 2}") for i in range(5)]
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    assert serve(spec, requests, params) == serve(eager, requests, params)
    assert spec.engine.speculator.stats.drafts


def test_a_dense_adapter_is_served_eagerly_beside_slotted_ones(model_dir):
    llm, eager = make_llm(model_dir), make_llm(model_dir, max_loras=0)
    lora = adapters_for(llm.engine.model, 1)["tuned-0"]
    dense = Adapter.init(llm.engine.model, LoRAConfig(full=True, targets=("o_proj",)), seed=3)
    for _, (d,) in dense.weights.items():
        d.data.normal_(0, 0.05)
    for engine_llm in (llm, eager):
        add_adapter(engine_llm.engine.model, "lora", lora.to("cpu", torch.float32))
        add_adapter(engine_llm.engine.model, "dense", dense.to("cpu", torch.float32))
    requests = [("l", list(range(3, 30)), "lora"), ("d", list(range(5, 25)), "dense"), ("b", [7, 8, 9], None)]
    assert serve(llm, requests) == serve(eager, requests)


# -- the GPU: slots inside the CUDA graphs ---------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("count,max_loras,merge", [(1, 8, True), (8, 8, True), (5, 2, True), (8, 8, False)])
def test_adapters_in_cuda_graphs_match_the_eager_reference(tmp_path, count, max_loras, merge, monkeypatch):
    """bf16: the logits of every sampled row, through the CUDA graphs with adapters in slots, against the eager
    forward with the adapters' hooks, in decode steps, prefill steps and mixed ones (requests arriving while others
    decode), for every position whose history both runs share (a near-tie that bf16 flips ends a sequence's
    comparison). merge: o's shrinks from the attention's merge in decode steps past 16 rows as shipped
    (kernels.lora.SHRINKS_IN_MERGE; 18 requests decode at once here), else from a lora_shrink launch."""
    import kernels.decode
    import kernels.lora

    monkeypatch.setattr(kernels.lora, "SHRINKS_IN_MERGE", merge)
    merges = []  # the graphs of 17-64 rows capture the merge with shrinks
    shrinking = kernels.decode.decode_attention_shrinks
    monkeypatch.setattr(kernels.decode, "decode_attention_shrinks",
                        lambda *args: merges.append(args[0].shape[0]) or shrinking(*args))
    path = make_tiny_model("qwen2", tmp_path, hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    graphs = LLM(str(path), device="cuda", dtype="bfloat16", max_loras=max_loras, num_kv_blocks=256)
    eager = LLM(str(path), device="cuda", dtype="bfloat16", max_loras=0, cuda_graphs=False, num_kv_blocks=256)
    assert graphs.engine.runner.lora_graphs and graphs.engine.runner.lora_prefill_graphs
    for name, adapter in adapters_for(graphs.engine.model, count, rank=8, std=0.05).items():
        for llm in (graphs, eager):
            add_adapter(llm.engine.model, name, adapter.to("cuda", torch.bfloat16))
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1000, (int(torch.randint(3, 100, (1,), generator=g)),), generator=g).tolist()
               for _ in range(18)]

    def run(llm):
        engine, runner, logits = llm.engine, llm.engine.runner, {}
        launch = runner.run

        def spy(batch, pending):  # each sampled row's logits, by (request, position of the token it samples)
            out, index, greedy = launch(batch, pending)
            for row, i in enumerate(index):
                logits[batch.seqs[i].request_id, len(batch.seqs[i].token_ids)] = out[row].float().cpu()
            return out, index, greedy

        runner.run = spy
        tokens = {}
        for wave in range(3):  # later waves arrive while earlier ones decode: mixed steps
            for i in range(6):
                rid = f"w{wave}-{i}"
                adapter = None if i == 5 else f"tuned-{i % count}"
                engine.add_request(rid, prompts[6 * wave + i], params, adapter=adapter)
                tokens[rid] = []
            for _ in range(3):
                for o in engine.step()[0]:
                    tokens[o.request_id].append(o.token_id)
        while engine.has_work:
            for o in engine.step()[0]:
                tokens[o.request_id].append(o.token_id)
        return tokens, logits

    (got, got_logits), (want, want_logits) = run(graphs), run(eager)
    assert bool(merges) == merge and all(16 < rows <= kernels.lora.ROW_SHRINK_MAX_ROWS for rows in merges)
    compared = 0
    for rid, tokens in want.items():
        start = len(prompts[int(rid[1]) * 6 + int(rid[3])])
        for j, (token, ref) in enumerate(zip(got[rid], tokens)):
            a, b = got_logits[rid, start + j], want_logits[rid, start + j]
            gap = (a.log_softmax(-1) - b.log_softmax(-1)).abs().max().item()
            assert gap < 0.1, (rid, j, gap, (a - b).abs().max().item(), a.abs().max().item())
            compared += 1
            if token != ref:
                break
    assert compared >= 0.8 * sum(map(len, want.values()))


def test_the_lora_benchmark_runs_on_the_cpu(tmp_path):
    import json

    from benchmarks.lora import main

    main(["--device", "cpu", "--out", str(tmp_path), "--steps", "2"])
    rows = json.loads((tmp_path / "lora.json").read_text())["decode"]
    # every row of a cell on its adapters, and at batch 4 a cell with one row on them (the served 5%'s steps)
    cells = {(b, a, b if a else 0) for b in (1, 4) for a in (0, 1, 2)} | {(4, 2, 1)}
    assert {(r["batch"], r["adapters"], r["adapter_rows"]) for r in rows} == cells
    assert all(r["step_ms"] > 0 and r["step_x"] > 0 for r in rows)
