import pytest


@pytest.fixture(scope="module")
def hf_dirs(request, tmp_path_factory):
    """{kind: directory}: the tiny HF model (seed 11) of each kind in the requesting test module's
    ``KINDS``, saved once per module (test_lora.py, test_lora_te.py)."""
    from gspo_megatron.models.tiny import save_tiny_hf_model

    out = {}
    for kind in request.module.KINDS:
        out[kind] = str(tmp_path_factory.mktemp(kind) / "hf")
        save_tiny_hf_model(kind, out[kind], seed=11)
    return out
