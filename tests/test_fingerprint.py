import json

from prefixcache.indexer.fingerprint import SAMPLE_BYTES, fingerprint_model


def make_model(directory, weights: bytes, config: dict):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "model.safetensors").write_bytes(weights)
    (directory / "tokenizer.json").write_text("{}")
    return directory


def test_fingerprint_tracks_weights_and_config_but_not_the_tokenizer(tmp_path):
    cache = tmp_path / "cache.json"
    base = fingerprint_model(str(make_model(tmp_path / "a", b"w" * 1000, {"layers": 2})), cache)
    assert base == fingerprint_model(str(make_model(tmp_path / "b", b"w" * 1000, {"layers": 2})), cache)
    assert base != fingerprint_model(str(make_model(tmp_path / "c", b"x" * 1000, {"layers": 2})), cache)
    assert base != fingerprint_model(str(make_model(tmp_path / "d", b"w" * 1000, {"layers": 3})), cache)
    (tmp_path / "b" / "tokenizer.json").write_text('{"changed": true}')
    assert base == fingerprint_model(str(tmp_path / "b"), cache)


def test_large_weights_are_sampled_and_the_result_cached(tmp_path):
    cache = tmp_path / "cache.json"
    size = 4 * SAMPLE_BYTES
    weights = bytearray(size)
    model = make_model(tmp_path / "m", bytes(weights), {})
    first = fingerprint_model(str(model), cache)
    assert json.loads(cache.read_text())["entries"]
    weights[size // 2 + 10] = 1  # inside the middle sample
    make_model(model, bytes(weights), {})
    assert fingerprint_model(str(model), cache) != first


def test_a_name_that_is_not_a_directory_is_fingerprinted_by_name(tmp_path):
    assert fingerprint_model("meta-llama/Llama-3-8B", tmp_path / "c.json") == "name:meta-llama/Llama-3-8B"
