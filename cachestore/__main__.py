from prefixcache.cachestore.cli.app import app

app(prog_name="prefixcache")
