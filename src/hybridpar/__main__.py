from hybridpar.commands.cli import entry

entry()
