"""What runs on an open engine: the job modes of a deployment (chat, batch, bench) and their shared parts."""
