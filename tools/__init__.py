"""Tools around the servers, not part of them: the command-line client and the local three-process stack."""
