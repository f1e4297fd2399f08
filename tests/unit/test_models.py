"""Model loading (specdec.models): the real ``from_pretrained`` path, safetensors only."""

from __future__ import annotations

import pytest

from specdec.errors import NotFound
from specdec.models import load_hf
from tests.support import make_gpt2


def test_pickled_weights_are_refused_with_a_way_out(tmp_path):
    """A folder with only pytorch_model.bin (a pickle, which can run code when loaded: a writable
    model cache is enough to plant one) is refused; the same model saved as safetensors loads."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "pickled"
    make_gpt2(folder, 0)
    model = AutoModelForCausalLM.from_pretrained(folder)
    (folder / "model.safetensors").unlink()
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    with pytest.raises(NotFound, match="safetensors") as err:
        load_hf(str(folder))
    assert "save_pretrained" in str(err.value)
    model.save_pretrained(folder)  # safetensors by default
    assert load_hf(str(folder)).model.config.model_type == "gpt2"
