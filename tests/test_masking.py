"""Visibility: causal, local windows, sequence lengths, bias and mask broadcasting, empty rows."""

from __future__ import annotations

import numpy as np
import pytest

from jax_flash import _config

from _harness import (Case, check_forward, check_gradients, default_dtype, default_head_dim,
                      live_rows, make_inputs, visibility)
from _platforms import platform_params, with_platform


def case_on(platform: str, **fields) -> Case:
  fields.setdefault("dtype", default_dtype(platform))
  fields.setdefault("H", default_head_dim(platform))
  return Case(**fields)


def check_with_empty_rows(case: Case, platform: str):
  """check_forward, after making sure the case really has rows that see no key."""
  inp = make_inputs(case)
  live = live_rows(case, visibility(case, inp))
  assert (~live).any() and live.any(), "the case must mix empty and live rows"
  check_forward(case, platform, inp=inp)


CAUSAL_PAIRS = [(7, 7), (64, 64), (65, 127), (127, 65), (1, 239), (239, 1), (113, 203),
                (203, 113)]


@pytest.mark.parametrize("T,S", CAUSAL_PAIRS, ids=[f"T{t}-S{s}" for t, s in CAUSAL_PAIRS])
def test_causal_is_top_left_aligned(platform, T, S):
  check_forward(case_on(platform, T=T, S=S, is_causal=True), platform)


def test_causal_with_more_queries_than_keys_sees_every_key_from_row_s(platform):
  """T > S: row i >= S - 1 sees all keys; row 0 sees key 0 only (output = v[0])."""
  case = case_on(platform, T=20, S=5, is_causal=True, N=1)
  inp = make_inputs(case)
  out, _ = check_forward(case, platform, inp=inp)
  np.testing.assert_array_equal(out[:, 0], inp.v[:, 0])


#: The last four reach past int32 (the last past int64): windows that cut nothing are unbounded
#: whatever their size.
WINDOWS = [0, 3, (5, 0), (0, 5), (16, 3), (2, 40), (1000, 1000), (2**40, 0), (3, 2**33),
           (2**31 - 1, 2**31 - 1), (2**70, 1)]


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("T,S", [(65, 127), (127, 65)], ids=["T65-S127", "T127-S65"])
def test_local_window(platform, window, T, S):
  check_forward(case_on(platform, T=T, S=S, window=window), platform)


@pytest.mark.parametrize("window", [5, (7, 0), (0, 3), (30, 30)], ids=str)
def test_local_window_with_causal(platform, window):
  check_forward(case_on(platform, T=70, S=90, window=window, is_causal=True), platform)


SEQ_LENGTHS = [
    ((3, 40, 0), None),  # a query length of 0: the whole batch item is padding
    (None, (5, 60, 0)),  # a key length of 0: every row of that item is empty
    ((45, 1, 29), (60, 1, 17)),
    ((40, 100, 41), (60, 61, 500)),  # lengths >= T and >= S change nothing
]


@pytest.mark.parametrize("q_lens,kv_lens", SEQ_LENGTHS, ids=["q0", "kv0", "both", "long"])
def test_sequence_lengths(platform, q_lens, kv_lens):
  check_forward(case_on(platform, B=3, T=40, S=60, q_lens=q_lens, kv_lens=kv_lens), platform)


def test_sequence_lengths_with_causal_and_gqa(platform):
  check_forward(case_on(platform, B=3, T=50, S=35, N=4, K=2, is_causal=True, q_lens=(50, 7, 33),
                        kv_lens=(35, 35, 9)), platform)


def test_sequence_lengths_mostly_zero(platform):
  """Five batch items in six have no query or no key, over enough heads and items that on the
  GPU every CTA of the persistent grid walks several tiles, most of them empty, in a row."""
  B = 24
  q_lens = tuple(0 if b % 2 else 200 for b in range(B))
  kv_lens = tuple(300 if b % 6 == 0 else 0 for b in range(B))
  check_forward(case_on(platform, B=B, N=16, K=4, T=200, S=300, q_lens=q_lens, kv_lens=kv_lens),
                platform)


@with_platform("platform,H", platform_params([16], list(_config.GPU_HEAD_DIMS)))
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_tiles_with_and_without_keys_in_a_row(platform, H, is_causal):
  """Tiles of several key blocks and tiles without keys (a key length of 0) in a row, about
  three per CTA of the GPU's persistent grid, at each compiled tile's head dim: each tile's
  output goes through shared memory that later tiles' loads reuse (at head dim 256 the K and V
  stages of its last key block, or for a tile without keys the Q tile)."""
  B = 24
  kv_lens = tuple(0 if b % 3 == 1 else 640 - 23 * b for b in range(B))
  check_forward(case_on(platform, B=B, N=8, K=4, T=256, S=640, H=H, is_causal=is_causal,
                        kv_lens=kv_lens), platform)


SECTION_SHAPES = [(5, 27, 256), (3, 45, 384), (7, 19, 128)]  # (B, N, T): 135, 135, 133 heads


@with_platform("platform,shape", platform_params([], SECTION_SHAPES,
                                                 ids=lambda s: "B{}-N{}-T{}".format(*s)))
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_sections_of_heads_that_do_not_divide_the_heads(platform, shape, is_causal):
  """More heads (batch items x heads) than the GPU has SMs, in counts that the tile walk's
  sections of heads do not divide, so that the last section is shorter (on a 132-SM GPU the
  backward's wave of 132 / 3 = 44 heads leaves 3 of 135 in it): the walk divides each tile's
  index by its own section's head count (tile_scheduler.h). Forward and gradients."""
  B, N, T = shape
  case = case_on(platform, B=B, N=N, K=N, T=T, S=T, H=64, is_causal=is_causal)
  check_forward(case, platform)
  check_gradients(case, platform)


BROADCAST_SPECS = ["BNTS", "1NTS", "B1TS", "BN1S", "BNT1", "11TS", "B11S", "1111", "NTS", "TS",
                   "S", ""]


@pytest.mark.parametrize("spec", BROADCAST_SPECS, ids=lambda s: s or "scalar")
def test_bias_broadcasting(platform, spec):
  check_forward(case_on(platform, B=2, N=3, T=17, S=29, bias=spec), platform)


@pytest.mark.parametrize("spec", BROADCAST_SPECS, ids=lambda s: s or "scalar")
def test_mask_broadcasting(platform, spec):
  check_forward(case_on(platform, B=2, N=3, T=17, S=29, mask=spec), platform)


COMBINED = [
    dict(mask="BNTS", bias="BNTS", is_causal=True, q_lens=(30, 11), kv_lens=(40, 25)),
    dict(mask="B1TS", bias="1NTS", is_causal=True, window=(9, 2), kv_lens=(13, 40)),
    dict(mask="11TS", bias="BNT1", window=(4, 6), q_lens=(22, 30), N=4, K=1),
    dict(mask="NTS", bias="TS", is_causal=True, q_lens=(0, 30), kv_lens=(40, 1), N=4, K=2),
]


@pytest.mark.parametrize("options", COMBINED, ids=[f"combo{i}" for i in range(len(COMBINED))])
def test_mask_bias_causal_window_and_lengths_combined(platform, options):
  check_forward(case_on(platform, B=2, T=30, S=40, **options), platform)


EMPTY_ROW_CASES = {
    "mask-rows": dict(mask="BNTS", dead_rows=True),
    "broadcast-mask-rows": dict(mask="1NTS", dead_rows=True, is_causal=True),
    "window-past-the-keys": dict(window=(0, 0), T=50, S=20),
    "causal-window-past-the-keys": dict(window=(3, 0), is_causal=True, T=50, S=20),
    "kv-length-0": dict(kv_lens=(0, 13)),
    "query-padding": dict(q_lens=(9, 0)),
}


@pytest.mark.parametrize("options", EMPTY_ROW_CASES.values(), ids=EMPTY_ROW_CASES.keys())
def test_rows_without_visible_keys_give_zero_and_minus_inf(platform, options):
  fields = dict(B=2, T=30, S=40)
  fields.update(options)
  check_with_empty_rows(case_on(platform, **fields), platform)


def test_all_false_mask_gives_zero_output(platform):
  case = case_on(platform, T=9, S=11, mask="1111")
  inp = make_inputs(case)
  inp.mask[...] = False
  out, lse = check_forward(case, platform, inp=inp)
  assert np.all(out.astype(np.float64) == 0) and np.all(lse == -np.inf)
