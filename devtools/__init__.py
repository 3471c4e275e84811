"""Development scripts: they write the repository's generated files (``make docs``) and ship in no wheel."""
