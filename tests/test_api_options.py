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
