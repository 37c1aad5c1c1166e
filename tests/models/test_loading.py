"""Loading targets: device and dtype defaults follow the device; a target without its decoder layers (offline
training) reads none of them and still computes the model's own logits."""

import pytest
import torch

from eyas.models import Target
from eyas.models.cpu_kernels import native_bf16
from eyas.models.errors import InputError
from eyas.models.loading import default_dtype, dtype_note, placement
from tests.helpers.tiny import tiny_model, tiny_tokenizer

# what torch reports on the two CPU kinds eyas runs on: AMD EPYC (AVX2 only) and Intel Xeon (AMX, AVX512-BF16)
AVX2_ONLY = {"avx2": True, "avx512_bf16": False, "amx_bf16": False}
AMX = {"avx2": True, "avx512_f": True, "avx512_bf16": True, "amx_bf16": True}


@pytest.mark.parametrize("cpu, native", [(AVX2_ONLY, None), (AMX, "AMX-BF16"),
                                         ({**AVX2_ONLY, "avx512_bf16": True}, "AVX512-BF16")])
def test_dtype_follows_the_device_and_what_its_cpu_computes_natively(monkeypatch, request, cpu, native):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: cpu)
    native_bf16.cache_clear()  # read once per process; this test plays other CPUs
    request.addfinalizer(native_bf16.cache_clear)
    cpu_dtype = "bf16" if native else "fp32"
    assert default_dtype("cuda") == default_dtype("cuda:1") == "bf16" and default_dtype("cpu") == cpu_dtype
    device, dtype = placement(None, "auto")
    assert (device, dtype) == (("cuda", "bf16") if torch.cuda.is_available() else ("cpu", cpu_dtype))
    assert placement("cpu", "bf16") == ("cpu", "bf16") and placement("cpu", "fp32") == ("cpu", "fp32")  # kept
    note = dtype_note("cpu", "auto", cpu_dtype)
    assert cpu_dtype in note and (native in note if native else "no native bf16" in note)
    assert dtype_note("cpu", "fp32", "fp32") == "dtype fp32 (asked for)"
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="no CUDA GPU"):
            placement("cuda", None)
        assert placement("auto", None) == ("cpu", cpu_dtype)  # auto = every visible GPU; none here
    with pytest.raises(InputError, match="unknown device"):
        placement("gpu0", None)


@pytest.mark.parametrize("tied", [False, True])
def test_a_target_without_decoder_layers_gives_the_models_own_logits(tmp_path, tied):
    tiny_model(tied=tied).save_pretrained(tmp_path / "t")
    tiny_tokenizer().save_pretrained(tmp_path / "t")
    full = Target.load(str(tmp_path / "t"), dtype="fp32")
    light = Target.load(str(tmp_path / "t"), dtype="fp32", decoder=False)
    assert all(p.device.type == "meta" for p in light._layers.parameters())
    assert all(p.device.type == "cpu" for n, p in light.model.named_parameters() if ".layers." not in n)
    assert (light.lm_head.weight is light.embed_tokens.weight) == tied
    hidden = torch.randn(2, 5, full.hidden_size)
    torch.testing.assert_close(light.logits(hidden), full.logits(hidden), rtol=1e-5, atol=1e-5)
    ids = torch.randint(0, 320, (2, 5))
    assert torch.equal(light.embed_tokens(ids), full.embed_tokens(ids))
