"""ModelConfig: validation names the fields at fault, YAML round-trips exactly, strict dict loading."""

import dataclasses
import re

import pytest

from attnlab.config import CHOICES, ConfigError, ModelConfig
from attnlab.experiment import from_raw, load_experiment, parse_value


def test_defaults_are_the_2017_base_transformer():
    cfg = ModelConfig()
    assert (cfg.d_model, cfg.n_heads, cfg.ffn_dim, cfg.n_enc_layers, cfg.n_dec_layers) == (512, 8, 2048, 6, 6)
    assert (cfg.norm, cfg.norm_position, cfg.ffn, cfg.position) == ("layernorm", "post", "relu", "sinusoidal")
    assert cfg.tie_embeddings == "all" and cfg.scale_embeddings and cfg.dropout == 0.1


@pytest.mark.parametrize(
    "changes",
    [
        {"ffn": "swiglu", "norm": "rmsnorm", "position": "rope", "n_kv_heads": 2, "qk_norm": True},
        {"arch": "decoder_only", "block": "parallel", "logit_softcap": 30.0, "attn_softcap": 50.0,
         "attention_backend": "eager", "z_loss": 1e-4, "rope_theta": 500000.0, "dropout": 0.0},
        {"norm_position": "sandwich", "tie_embeddings": "none", "src_vocab_size": 1000, "d_ff": 1234},
    ],
)
def test_yaml_round_trip_is_exact(changes):
    cfg = ModelConfig(**changes)
    back = ModelConfig.from_yaml(cfg.to_yaml())
    assert back == cfg
    assert back.to_yaml() == cfg.to_yaml()


# a valid non-default value for every field: together they are one config that runs
NON_DEFAULT = dict(
    arch="decoder_only", vocab_size=1234, src_vocab_size=99, d_model=96, n_heads=6, n_kv_heads=3, head_dim=24,
    v_head_dim=20, n_enc_layers=0,
    n_dec_layers=5, d_ff=333, ffn_multiple_of=64, max_seq_len=77, norm="rmsnorm", norm_position="sandwich",
    norm_eps=1e-6, ffn="geglu", attn_bias=False, ffn_bias=False, norm_bias=False, block="parallel", qk_norm=True,
    position="rope", rope_theta=123456.789, rope_fraction=0.25, tie_embeddings="none", scale_embeddings=False,
    embed_norm=True, dropout=0.123, attn_dropout=0.05, logit_softcap=30.5, attn_softcap=50.25, z_loss=1e-4,
    attention_backend="eager", init="normal", init_std=0.0123, pad_id=7,
)


def test_every_field_round_trips_through_yaml():
    assert set(NON_DEFAULT) == {f.name for f in dataclasses.fields(ModelConfig)}
    cfg = ModelConfig(**NON_DEFAULT)
    default = ModelConfig()
    assert all(getattr(cfg, k) != getattr(default, k) for k in NON_DEFAULT)
    back = ModelConfig.from_yaml(cfg.to_yaml())
    assert back == cfg and back.to_yaml() == cfg.to_yaml()
    for k, v in NON_DEFAULT.items():  # the same values, the same types (no float turned str or int)
        assert getattr(back, k) == v and type(getattr(back, k)) is type(v), k


def test_ints_for_float_fields_are_normalised():
    cfg = ModelConfig.from_dict({"rope_theta": 10000, "dropout": 0})
    assert isinstance(cfg.rope_theta, float) and cfg == ModelConfig(rope_theta=10000.0, dropout=0.0)


def test_gated_ffn_width_is_eight_thirds_rounded_up():
    assert ModelConfig(ffn="swiglu", d_model=512).ffn_dim == 1536  # 1365.3 -> multiple of 256
    assert ModelConfig(ffn="geglu", d_model=768, ffn_multiple_of=64).ffn_dim == 2048
    assert ModelConfig(ffn="gelu", d_model=768).ffn_dim == 3072
    assert ModelConfig(ffn="swiglu", d_ff=100).ffn_dim == 100


def test_head_sizes_apart_from_d_model_over_n_heads():
    cfg = ModelConfig()
    assert (cfg.head_dim, cfg.d_k, cfg.d_v) == (0, 64, 64)  # 0: derived, d_model / n_heads
    cfg = ModelConfig(d_model=100, n_heads=8, head_dim=16)  # d_model need not divide by n_heads then (Gemma)
    assert (cfg.d_k, cfg.d_v) == (16, 16)
    assert (ModelConfig(head_dim=16, v_head_dim=64).d_k, ModelConfig(head_dim=16, v_head_dim=64).d_v) == (16, 64)


@pytest.mark.parametrize(
    "changes, fields",
    [
        ({"d_model": 100, "n_heads": 8}, ["d_model", "n_heads", "head_dim"]),
        ({"head_dim": -8}, ["head_dim"]),
        ({"v_head_dim": 32, "attention_backend": "flash_attn"}, ["v_head_dim", "attention_backend"]),
        ({"n_heads": 8, "n_kv_heads": 3}, ["n_heads", "n_kv_heads"]),
        ({"attn_softcap": 30.0}, ["attn_softcap", "attention_backend"]),
        ({"position": "alibi", "attention_backend": "flash_attn"}, ["position", "attention_backend"]),
        ({"tie_embeddings": "all", "src_vocab_size": 10}, ["tie_embeddings", "src_vocab_size"]),
        ({"arch": "decoder_only", "n_dec_layers": 0}, ["arch", "n_dec_layers"]),
        ({"dropout": 1.0}, ["dropout"]),
        ({"position": "rope", "d_model": 24, "n_heads": 8}, ["position", "rope_fraction"]),
        ({"rope_fraction": 0.0}, ["rope_fraction"]),
        ({"position": "rope", "d_model": 32, "n_heads": 4, "rope_fraction": 0.1}, ["position", "rope_fraction"]),
        ({"pad_id": 99, "vocab_size": 50}, ["pad_id"]),
        ({"vocab_size": 0}, ["vocab_size"]),
    ],
)
def test_invalid_combinations_name_the_fields(changes, fields):
    with pytest.raises(ConfigError) as e:
        ModelConfig(**changes)
    for f in fields:
        assert f"model.{f}" in str(e.value)


@pytest.mark.parametrize("key", list(CHOICES))
def test_unknown_choice_lists_the_valid_ones(key):
    with pytest.raises(ConfigError) as e:
        ModelConfig(**{key: "bogus"})
    assert f"model.{key}='bogus'" in str(e.value)
    assert all(v in str(e.value) for v in CHOICES[key])


def test_unknown_and_mistyped_keys_are_rejected_with_the_key_path():
    with pytest.raises(ConfigError, match=r"model\.nrom.*did you mean model\.norm"):
        ModelConfig.from_dict({"nrom": "rmsnorm"})
    with pytest.raises(ConfigError, match=r"model\.d_model='512'.*expected int"):
        ModelConfig.from_dict({"d_model": "512"})
    with pytest.raises(ConfigError, match=r"model\.qk_norm=1 .*expected bool"):
        ModelConfig.from_dict({"qk_norm": 1})
    with pytest.raises(ConfigError, match=r"model\.dropout=True"):
        ModelConfig(dropout=True)


def test_a_float_that_is_not_finite_is_refused_naming_the_file_and_key(tmp_path):
    """YAML reads .inf, .nan and 1e400 as floats; lr > 0 and the like would let infinity through."""
    recipe = tmp_path / "r.yaml"
    for text, shown in ((".inf", "inf"), ("1e400", "inf"), (".nan", "nan"), ("-.inf", "-inf")):
        recipe.write_text(f"name: r\nmodel: {{}}\noptim: {{lr: {text}}}\ndata: {{corpus: x.tsv}}\n", encoding="utf-8")
        with pytest.raises(ConfigError, match=rf"^{re.escape(str(recipe))}: optim\.lr={shown} must be a finite number"):
            load_experiment(recipe)


def test_floats_in_exponent_notation_are_floats_in_recipes_and_overrides(tmp_path):
    """PyYAML (YAML 1.1) reads 1e-6 as a string; attnlab reads it as YAML 1.2 and as the user means it."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\nmodel: {norm_eps: 1e-6}\noptim: {lr: 2E-3, beta2: .98}\ndata: {corpus: x.tsv}\n"
                      "trainer: {run_name: '1e5'}\n", encoding="utf-8")
    exp = load_experiment(recipe, {"optim.weight_decay": parse_value("1e-2")})
    assert (exp.model.norm_eps, exp.optim.lr, exp.optim.beta2, exp.optim.weight_decay) == (1e-6, 2e-3, 0.98, 0.01)
    assert exp.trainer.run_name == "1e5"  # quoted: a string still
    assert [parse_value(t) for t in ("3e-4", "-1.5e+2", "1.0e-6", "1e", "e5", "12")] == [
        3e-4, -150.0, 1e-6, "1e", "e5", 12]


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ModelConfig().d_model = 3


def test_yaml_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("d_model: [1,\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        ModelConfig.from_yaml(bad)
    with pytest.raises(ConfigError, match="not found"):
        ModelConfig.from_yaml(tmp_path / "missing.yaml")


# The run hashes of the shipped recipes as the first release of attnlab named their run directories. A field added
# since must keep them (experiment.HASHED_AS_BEFORE), or `--ckpt-path last` would not find an older run. The demo's
# own recipe changed since (it set trainer.val_every_min and ckpt_every_min): its hash is the one after that change.
FIRST_HASHES = {"demo_en_de": "0a71725736", "wmt14_en_de_base": "2a0d90ee2d", "wmt14_en_de_big": "cc382586f7",
                "lm_demo": "16593a3ebb"}


@pytest.mark.parametrize("recipe", sorted(FIRST_HASHES))
def test_fields_added_later_keep_old_run_directories_while_they_hold_their_defaults(recipe):
    exp = load_experiment(f"experiments/{recipe}.yaml")
    assert exp.config_hash() == FIRST_HASHES[recipe]
    assert exp.replace(model=exp.model.replace(embed_norm=True)).config_hash() != FIRST_HASHES[recipe]
    assert exp.replace(data=exp.data.replace(locale_dir=["/opt/locale"])).config_hash() != FIRST_HASHES[recipe]
    # what decodes the run (CTranslate2 or attnlab) is not what is trained: one run directory for both
    assert exp.replace(decode=exp.decode.replace(engine="ctranslate2")).config_hash() == FIRST_HASHES[recipe]
    flipped = exp.decode.replace(cuda_graph=not exp.decode.cuda_graph)
    assert exp.replace(decode=flipped).config_hash() == FIRST_HASHES[recipe]




def test_flash_attn_in_32_bit_precision_is_refused_naming_both_keys():
    raw = {"model": {"attention_backend": "flash_attn"}, "data": {}, "trainer": {"precision": "32-true"}}
    with pytest.raises(ConfigError, match=r"attention_backend=flash_attn.*trainer\.precision=32-true"):
        from_raw(raw)
    from_raw({**raw, "trainer": {"precision": "bf16-mixed"}})  # 16-bit activations: accepted


def test_settings_at_odds_across_sections_are_refused_naming_both_and_the_file(tmp_path):
    """Two BPEs cannot share one embedding table (their ids mean other pieces), and a learned position table
    shorter than data.max_len fails at whichever step first draws a long pair: both refused when the recipe loads."""
    with pytest.raises(ConfigError, match=r"^<dict>: model\.tie_embeddings=all .*data\.joint_vocab=false"):
        from_raw({"model": {}, "data": {"joint_vocab": False}})
    from_raw({"model": {"tie_embeddings": "decoder"}, "data": {"joint_vocab": False}})
    from_raw({"model": {"arch": "decoder_only"}, "data": {"joint_vocab": False}})  # one vocabulary anyway
    with pytest.raises(ConfigError, match=r"model\.max_seq_len=16 .*data\.max_len=32"):
        from_raw({"model": {"position": "learned", "max_seq_len": 16}, "data": {"max_len": 32}})
    from_raw({"model": {"position": "learned", "max_seq_len": 32}, "data": {"max_len": 32}})
    from_raw({"model": {"max_seq_len": 16}, "data": {"max_len": 32}})  # sinusoidal: no table to run past
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\nmodel: {}\ndata: {corpus: x.tsv, joint_vocab: false}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(recipe))}: model\.tie_embeddings=all"):
        load_experiment(recipe)
