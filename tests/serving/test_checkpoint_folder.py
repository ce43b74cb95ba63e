"""``examples.models.from_pretrained`` reads a Hugging Face checkpoint folder without
PyTorch: ``config.json`` (transformers' defaults for the fields older files leave out) and
the safetensors weights, one file or the shards of ``model.safetensors.index.json``;
``bfloat16`` tensors are widened to float32 exactly. The folders here are written with
NumPy (``safetensors.numpy``, and a hand-written ``BF16`` file), so no test needs torch;
the loader runs in a process where ``import torch`` fails. Bad folders raise a
``ValueError`` naming what is wrong."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from flax import nnx

pytest.importorskip("safetensors")
from safetensors.numpy import save_file  # noqa: E402

from examples.models import from_pretrained  # noqa: E402
from examples.models.pretrained import CheckpointConfig, load_safetensors  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
# a 1-layer Llama: vocab 16, hidden 8, 2 query heads and 1 key/value head of width 4
CONFIG = {"model_type": "llama", "vocab_size": 16, "hidden_size": 8, "intermediate_size": 12,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
          "head_dim": 4}
SHAPES = {"model.embed_tokens.weight": (16, 8), "model.norm.weight": (8,),
          "lm_head.weight": (16, 8),
          "model.layers.0.input_layernorm.weight": (8,),
          "model.layers.0.post_attention_layernorm.weight": (8,),
          "model.layers.0.self_attn.q_proj.weight": (8, 8),
          "model.layers.0.self_attn.k_proj.weight": (4, 8),
          "model.layers.0.self_attn.v_proj.weight": (4, 8),
          "model.layers.0.self_attn.o_proj.weight": (8, 8),
          "model.layers.0.mlp.gate_proj.weight": (12, 8),
          "model.layers.0.mlp.up_proj.weight": (12, 8),
          "model.layers.0.mlp.down_proj.weight": (8, 12)}


def _tensors(seed=0):
    rs = np.random.RandomState(seed)
    return {k: rs.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def _folder(path, tensors, *, shards=1, config=CONFIG):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
        return path
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(path / file))
        weight_map.update(dict.fromkeys(part, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def _write_bf16(file, name, values):
    """A safetensors file with one BF16 tensor (the format: 8-byte header length, JSON
    header, data), written by hand: NumPy has no bfloat16 to save."""
    bits = (np.asarray(values, np.float32).view(np.uint32) >> 16).astype("<u2")
    header = json.dumps({name: {"dtype": "BF16", "shape": list(bits.shape),
                                "data_offsets": [0, bits.nbytes]}}).encode()
    header += b" " * (-len(header) % 8)
    file.write_bytes(len(header).to_bytes(8, "little") + header + bits.tobytes())


def test_sharded_folder_loads_every_tensor_into_its_parameter(tmp_path):
    t = _tensors()
    model = from_pretrained(_folder(tmp_path / "sharded", t, shards=3))
    attn = model.layers[0].self_attn
    np.testing.assert_array_equal(np.asarray(attn.q_proj.kernel[...]),
                                  t["model.layers.0.self_attn.q_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(model.embed_tokens.embedding[...]),
                                  t["model.embed_tokens.weight"])
    np.testing.assert_array_equal(np.asarray(model.layers[0].mlp.down_proj.kernel[...]),
                                  t["model.layers.0.mlp.down_proj.weight"].T)
    # defaults of transformers' LlamaConfig for the fields the file leaves out
    assert model.config.rms_norm_eps == 1e-6 and model.config.attention_bias is False
    single = from_pretrained(_folder(tmp_path / "single", t))
    flat = lambda m: dict(nnx.to_flat_state(nnx.state(m, nnx.Param)))
    one, many = flat(single), flat(model)
    assert one.keys() == many.keys() and len(one) == len(SHAPES)
    for path in one:
        np.testing.assert_array_equal(np.asarray(one[path].get_value()),
                                      np.asarray(many[path].get_value()))


def test_bfloat16_tensors_widen_exactly(tmp_path):
    values = np.array([[1.5, -2.0, 0.0078125], [3.140625, -0.0, 65280.0]], np.float32)
    _write_bf16(tmp_path / "w.safetensors", "w", values)
    got = load_safetensors([str(tmp_path / "w.safetensors")])["w"]
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, values)


def test_loading_needs_no_torch(tmp_path):
    t = _tensors(1)
    folder = _folder(tmp_path / "ckpt", t, shards=2)
    script = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None  # any import of torch now fails
        sys.path.insert(0, {str(ROOT)!r})
        import numpy as np
        from examples.models import from_pretrained
        m = from_pretrained({str(folder)!r})
        print(float(np.asarray(m.norm.scale[...]).sum()))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split()[-1]) == pytest.approx(float(t["model.norm.weight"].sum()),
                                                          rel=1e-6)


def test_bad_folders_raise_naming_the_problem(tmp_path):
    t = _tensors()
    with pytest.raises(ValueError, match="is not a directory"):
        from_pretrained(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        from_pretrained(tmp_path / "empty")
    unknown = _folder(tmp_path / "unknown", t, config={**CONFIG, "model_type": "mamba"})
    with pytest.raises(ValueError, match="model_type 'mamba'.*no example port.*'llama'"):
        from_pretrained(unknown)
    multi = _folder(tmp_path / "multi", t, config={**CONFIG, "model_type": "gemma3"})
    with pytest.raises(ValueError, match="multimodal.*'gemma3_text'"):
        from_pretrained(multi)
    pickles = tmp_path / "pickles"
    pickles.mkdir()
    (pickles / "config.json").write_text(json.dumps(CONFIG))
    (pickles / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="no model.safetensors.*pytorch_model.bin"):
        from_pretrained(pickles)
    sharded = _folder(tmp_path / "lost_shard", t, shards=2)
    next(sharded.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(ValueError, match="names shard"):
        from_pretrained(sharded)
    short = dict(t)
    del short["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="no key 'model.layers.0.mlp.up_proj.weight'"):
        from_pretrained(_folder(tmp_path / "short", short))


def test_a_truncated_or_foreign_weights_file_raises_a_value_error_naming_it(tmp_path):
    # safetensors' own SafetensorError (not a ValueError) escaped before
    cut = _folder(tmp_path / "cut", _tensors())
    file = cut / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"cannot read .*model\.safetensors"):
        from_pretrained(cut)
    foreign = _folder(tmp_path / "foreign", _tensors())
    (foreign / "model.safetensors").write_bytes(b"PK\x03\x04 not a safetensors file")
    with pytest.raises(ValueError, match=r"cannot read .*model\.safetensors"):
        from_pretrained(foreign)


@pytest.mark.slow  # compiles the loop's prefill and decode steps (~10 s of CPU)
def test_serve_example_serves_a_checkpoint_folder(tmp_path):
    """``examples/serve.py --checkpoint DIR``: the long-tail workload over the folder's
    model (its vocabulary), every request its token budget."""
    from _scripts import load_script

    folder = _folder(tmp_path / "ckpt", _tensors(2), shards=2)
    serve = load_script("examples/serve.py", "_serve_ckpt")
    sizes = dict(prompt_median=5, output_median=4, max_prompt=12, max_output=12)
    out = serve.main(["--checkpoint", str(folder), "--requests", "5", "--slots", "2",
                      "--page-size", "4", "--max-len", "24", "--prefill-chunk", "4",
                      "--no-progress", *[f"--{k.replace('_', '-')}={v}"
                                         for k, v in sizes.items()]])
    budget = sum(r.max_new_tokens for r in serve.long_tail_requests(
        5, vocab_size=CONFIG["vocab_size"], **sizes))
    s = out["continuous"]
    assert s["requests"] == 5 and s["generated_tokens"] == budget
    # one page: 4 slots x (1 key + 1 value head of 4 float32) x 1 layer
    assert s["peak_kv_mib_paged"] == round(s["peak_pages"] * 4 * 2 * 4 * 4 / 2**20, 3)


def test_ports_build_library_caches_and_gpt2_refuses_a_streaming_one():
    """``init_cache`` of a port gives one library cache per layer (paged with
    ``page_size=``, what ModuleDecoder asks for); GPT-2 adds learned positions at the input,
    so a StreamingLLM cache (re-numbered places) is refused by name."""
    from examples.models import gpt2, llama
    from jaxpos.layers.cache import KVCache, PagedKVCache

    model = llama.LlamaForCausalLM(llama.LlamaConfig.from_hf(
        CheckpointConfig(CONFIG)), rngs=nnx.Rngs(0))
    dense = model.init_cache(2, 8)
    paged = model.init_cache(2, 8, page_size=4, num_pages=3)
    assert [type(c) for c in dense] == [KVCache] and [type(c) for c in paged] == [PagedKVCache]
    assert paged[0].k_pages.shape == (3, 4, 1, 4) and model.vocab_size == 16
    g = gpt2.GPT2LMHeadModel(gpt2.GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1,
                                             n_head=2), rngs=nnx.Rngs(0))
    assert g.init_cache(1, 8, page_size=4)[0].k_pages.shape[1:] == (4, 2, 4)
    with pytest.raises(ValueError, match="keep_first=2: GPT-2 adds learned absolute"):
        g.init_cache(1, 8, keep_first=2)
