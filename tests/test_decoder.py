"""workers.models.decoder.decoder_of: the decoder of every family's CausalLM, including Llama-4's (whose base_model
is the CausalLM itself)."""

from __future__ import annotations

import pytest
from families_cases import FAMILIES, ids, make_teacher
from torch import nn

from workers.models.decoder import decoder_of


@pytest.mark.parametrize("family", FAMILIES)
def test_the_decoder_gives_the_hidden_states_the_lm_head_reads(family):
    model = make_teacher(family)
    dec = decoder_of(model)
    assert dec is not model and isinstance(
        getattr(dec, "layers", getattr(dec, "blocks", None)), nn.ModuleList
    )
    x = ids(n=1, t=6)
    last = model(input_ids=x, output_hidden_states=True).hidden_states[-1]
    assert last.shape[:2] == (1, 6)
    # exact: the CausalLM's forward runs this very decoder on the same input: the same ops in the same order
    assert (last - dec(input_ids=x).last_hidden_state).abs().max() == 0


def test_llama4_text_decoder_is_its_model_attribute():
    model = make_teacher("llama4_text")
    assert model.base_model is model and decoder_of(model) is model.model


def test_a_model_without_a_decoder_is_a_one_line_error():
    class Bare(nn.Module):
        base_model_prefix = "x"

        @property
        def base_model(self):
            return self

    with pytest.raises(
        ValueError, match=r"^Bare: base_model is the model itself and it has no `\.model` decoder$"
    ):
        decoder_of(Bare())
