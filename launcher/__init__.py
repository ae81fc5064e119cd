"""What a user touches: the `launch` CLI, its tools and front ends."""
