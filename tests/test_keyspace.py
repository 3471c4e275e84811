"""The Redis keyspace has one owner, ``indexer/keyspace.py``: no other module of the package builds a key name, the
Lua scripts spell none (they are handed the keyspace's names), and the documents that show the layout are generated
from it."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools import key_tables
from prefixcache.cachestore.node.redis_server import index_user_acl
from prefixcache.indexer.errors import ConfigError
from prefixcache.indexer.keyspace import LAYOUT, Keyspace

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ("cachestore", "connector", "indexer")
OWNER = ROOT / "indexer" / "keyspace.py"

#: The first word of every key name after its prefix: ``e`` of ``e:<key>``, ``quota`` of ``quota:lock``.
NAMES = sorted({re.split(r"[:<]", kind.pattern)[0] for kind in LAYOUT}, key=len, reverse=True)
#: A string piece that continues a prefix into a key name: ``"pq:"``, ``"ns"``, ``":quotas"``.
#: Also a hash tag opened after a prefix (``f"{root}{{{tag}}}:"``) and a pattern over a prefix (``prefix + "*"``).
KEY_PIECE = re.compile(rf"^:?(?:{'|'.join(map(re.escape, NAMES))})(?::|$)|^\{{$|^\*|^\(?\{{\*")


def key_building_sites(paths: list[Path]) -> Iterator[str]:
    """Where a string is built of something formatted or added, then a key name: ``f"{prefix}pq:{node}"``,
    ``f"{key_prefix}:quotas"``, ``prefix + "ns"``, ``key_prefix + ":"``."""
    for path in paths:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            pieces: list[str] = []
            if isinstance(node, ast.JoinedStr):
                pieces = [
                    part.value
                    for before, part in zip(node.values, node.values[1:], strict=False)
                    if isinstance(before, ast.FormattedValue) and isinstance(part, ast.Constant)
                ]
            elif (
                isinstance(node, ast.BinOp)
                and isinstance(node.op, ast.Add)
                and isinstance(node.right, ast.Constant)
                and isinstance(node.right.value, str)
            ):
                pieces = [node.right.value]
                # the ':' of the prefix itself, added by hand
                if pieces == [":"] and "prefix" in ast.unparse(node.left).lower():
                    pieces = [":ns"]
            if any(KEY_PIECE.match(piece) for piece in pieces):
                yield f"{path.relative_to(ROOT)}:{node.lineno}"


def package_files() -> list[Path]:
    return sorted(p for top in PACKAGE for p in (ROOT / top).rglob("*.py") if p != OWNER)


def test_no_redis_key_is_built_outside_the_keyspace():
    sites = sorted(set(key_building_sites(package_files())))
    assert not sites, "Redis key names built outside indexer/keyspace.py (name them there):\n" + "\n".join(sites)


def test_the_finder_finds_key_building(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        'a = f"{prefix}pq:{node}"\nb = f"{key_prefix}:quota:lock"\nc = prefix + "ns"\nd = key_prefix + ":"\n'
        'e = shard.shared + "f:" + node\nf = f"{x}:{y}"\ng = name + ".json"\n'
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert list(key_building_sites([sample])) == [f"sample.py:{n}" for n in (1, 2, 3, 4, 5)]
    finally:
        ROOT = saved


#: A key name as a Lua string: appended to something (``C .. 'e:'``, ``S .. 'keys'``, ``R .. 'ns'``), a hash tag's
#: delimiter (``'{'``, ``'}:'``), or a name with its ``':'`` anywhere (``'f:'``).
_NAME = "|".join(map(re.escape, NAMES))
LUA_KEY_NAME = re.compile(rf"\.\.\s*'(?:{_NAME})(?::[^']*)?'|'[^']*[{{}}][^']*'|'(?:{_NAME}):'")


def lua_key_spellings(name: str, text: str) -> Iterator[str]:
    """Where the Lua ``text`` (of file ``name``) spells a key name, outside its comments."""
    for number, line in enumerate(text.splitlines(), 1):
        if not line.startswith("#!") and (found := LUA_KEY_NAME.search(line.split("--", 1)[0])):
            yield f"{name}:{number}: {found.group()}"


def test_the_scripts_spell_no_key_name():
    sites = [
        site
        for path in sorted((ROOT / "indexer" / "lua").glob("*.lua"))
        for site in lua_key_spellings(path.name, path.read_text())
    ]
    assert not sites, "key names spelled in indexer/lua (hand them over from Keyspace.script_names):\n" + "\n".join(
        sites
    )


def test_the_finder_finds_key_names_in_lua():
    sample = (
        "local e = C .. 'e:' .. key\n"
        "local t = R .. '{' .. anchor .. '}:'\n"
        "redis.call('ZADD', S .. 'keys', 0, key)\n"
        "local f = 'f:'\n"
        "local n = redis.call('HMGET', e, 'ns', 'size')  -- S .. 'keys' in a comment\n"
        "local l = 'l:' .. location .. ':chunks'\n"
    )
    assert [site.split(":")[1] for site in lua_key_spellings("sample.lua", sample)] == ["1", "2", "3", "4"]


def test_the_scripts_are_handed_the_names_the_keyspace_lists():
    listed = {kind.pattern.split("<")[0] for kind in LAYOUT if kind.level in "CS"}
    words = dict(word.split("=", 1) for word in Keyspace("pc").script_names.split(" "))
    assert (words.pop("root"), words.pop("tag_open"), words.pop("tag_close")) == ("pc:", "{", "}:")
    assert set(words.values()) <= listed, f"names handed to the scripts that LAYOUT does not list: {words}"
    assert Keyspace("pc").chain("ab") == "pc:" + "{" + "ab" + "}:"


def test_the_key_tables_are_generated_from_the_keyspace():
    for path in key_tables.BLOCKS:
        text = (ROOT / path).read_text()
        assert key_tables.rendered(path, text) == text, f"{path} is out of date: run make docs"
    check = subprocess.run([sys.executable, "-m", "devtools.key_tables", "--check"], cwd=ROOT, capture_output=True)
    assert check.returncode == 0, check.stderr


def test_every_key_kind_is_in_the_docs_table():
    page = (ROOT / "docs" / "architecture.md").read_text()
    for kind in LAYOUT:
        assert f"| `P:{kind.pattern}` |" in page
    assert "| `P:quota:lock` |" in page


def test_the_acl_pattern_in_the_guide_is_the_keyspace_s():
    guide = (ROOT / "deploy" / "GUIDE.md").read_text()
    assert Keyspace("pc").acl_pattern == "~pc:*"
    assert f" {Keyspace('pc').acl_pattern} " in index_user_acl("prefixcache", "PASSWORD", "pc")
    assert index_user_acl("prefixcache", "PASSWORD", "pc") in guide


def test_the_keyspace_names_each_key_under_its_prefix():
    keys = Keyspace("pc")
    assert keys.root == "pc:"
    assert keys.promotion_queue("n1") == "pc:pq:n1" and keys.promotion_reply("r") == "pc:pr:r"
    assert keys.extents_queue("n1") == "pc:xq:n1" and keys.extents_reply("r") == "pc:xr:r"
    assert keys.eviction_queue("n1") == "pc:dq:n1" and keys.eviction_reply("r") == "pc:dr:r"
    assert keys.client_stats("n1") == "pc:cs:n1" and keys.kv_sequence("n1") == "pc:kvseq:n1"
    assert (keys.quotas, keys.quota_room, keys.quota_lock) == ("pc:quotas", "pc:quota:room", "pc:quota:lock")
    assert keys.quota_spent("r1", "tenant:a") == "pc:quota:spent:r1:tenant:a"
    assert (keys.namespaces, keys.peers, keys.deployment_probe) == ("pc:ns", "pc:peers", "pc:deployment-probe")
    assert keys.chain("") == "pc:" and keys.chain("ab") == "pc:{ab}:"
    assert keys.entry(keys.chain("ab"), "cd") == "pc:{ab}:e:cd" and keys.bucket("pc:", "ef") == "pc:b:ef"
    assert keys.entry_pattern(clustered=True) == "pc:{*}:e:*" and keys.entry_pattern(clustered=False) == "pc:e:*"


@pytest.mark.parametrize("bad", ["", "a b", "a{b", "a}"])
def test_a_bad_prefix_is_refused(bad):
    with pytest.raises(ConfigError, match="key_prefix"):
        Keyspace(bad)
