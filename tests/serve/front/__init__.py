# Tests of serve/http (the HTTP front). Not named `http`: a script run from tests/serve/ (multinode_script.py) has
# that folder first on sys.path, where a package named http would shadow the standard library's.
