"""Ray: attach to or start a cluster, place one actor per rank, check the nodes before any process group."""
