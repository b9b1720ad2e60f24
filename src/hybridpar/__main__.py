from hybridpar.cli import entry

entry()
