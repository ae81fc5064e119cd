"""moelaunch: a distributed inference launcher and engine for DeepSeek-V3-architecture MoE models.

Subpackages, from the user's side down (each imports only those below it; .importlinter checks it):
launcher -> measure -> tools -> training -> engine -> cluster, parallel -> model -> tasks -> text, kernels.
"""
