from cachestore.cli import app

app(prog_name="prefixcache")
