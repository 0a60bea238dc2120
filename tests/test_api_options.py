"""CPU tier: every public function hands the options a call uses to the kernel family (softcap, ALiBi,
dropout, deterministic, variable-length offsets) — checked with recording stand-ins for the launchers."""
import pytest

from cuflash import api
from test_bad_input_table import FAMILIES, arrays, slopes, spec_env  # noqa: F401  (fixture)


@pytest.fixture
def recorded(spec_env, monkeypatch):  # noqa: F811
    calls = []
    for name, fam in FAMILIES.items():
        for direction in ("forward", "backward"):
            def launch(*args, _n=name, _d=direction, **kwargs):
                calls.append((_n, _d, kwargs))
            monkeypatch.setattr(fam, direction, launch, raising=False)
    return calls


DROP = dict(dropout_p=0.1, dropout_seed=7, dropout_offset=3)


def test_forward_passes_options(recorded):
    a = arrays()
    api.flash_attn_func(a["q"], a["k"], a["v"], softcap=5.0, alibi_slopes=slopes(), impl="fa2", **DROP)
    (name, direction, kwargs), = recorded
    assert (name, direction) == ("fa2", "forward")
    assert kwargs["softcap"] == 5.0 and kwargs["dropout"] == (0.1, 7, 3) and kwargs["alibi_slopes"] is not None


def test_backward_passes_options(recorded):
    a = arrays()
    api.flash_attn_backward(a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"], softcap=5.0,
                            alibi_slopes=slopes(), deterministic=True, impl="fa2", **DROP)
    (name, direction, kwargs), = recorded
    assert (name, direction) == ("fa2", "backward")
    assert kwargs["dropout"] == (0.1, 7, 3) and kwargs["deterministic"] is True and kwargs["softcap"] == 5.0
    assert kwargs["alibi_slopes"] is not None


def test_no_options_when_unused(recorded):
    a = arrays()
    api.flash_attn_func(a["q"], a["k"], a["v"], impl="fa1")
    (_, _, kwargs), = recorded
    assert kwargs == {}


def test_v_head_dim_other_than_q_s_goes_to_fa3_forward(spec_env, monkeypatch):  # noqa: F811
    """v of head dim 128 beside q and k of 192 (fa3.FWD_HEADDIM_V): impl="auto" picks FA3's forward, which
    gets Dims with headdim_v set and an out of v's head dim (fixed-length and packed)."""
    from cuflash import fa3
    from test_bad_input_table import spec, varlen_arrays

    import sys

    cupy = sys.modules["cupy"]  # spec_env's stand-in: what the call allocates shows in its call records
    seen = []
    monkeypatch.setattr(fa3, "forward", lambda q, k, v, out, lse, dims, *rest, **kw: seen.append(dims))
    a = arrays(d=192, v=spec((2, 80, 2, 128)))
    api.flash_attn_func(a["q"], a["k"], a["v"])
    assert cupy.empty.call_args_list[0].args[0] == (2, 64, 8, 128)  # out: (batch, seqlen_q, heads, v's d)
    va = varlen_arrays(d=192, v=spec((80, 2, 128)))
    api.flash_attn_varlen_func(va["q"], va["k"], va["v"], va["cu_seqlens_q"], va["cu_seqlens_k"], va["max_seqlen_q"],
                               va["max_seqlen_k"])
    assert cupy.zeros.call_args_list[-1].args[0] == (64, 8, 128)  # packed out: (total_q, heads, v's d)
    fixed, packed = seen
    assert fixed.headdim == packed.headdim == 192 and fixed.headdim_v == packed.headdim_v == fixed.dv == 128
