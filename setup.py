"""One installed package, `moelaunch`, whose parts stay top-level folders of the repository.

`moelaunch.model` is model/, `moelaunch.kernels` is kernels/, and so on; `moelaunch` itself is a namespace
package, so nothing but `moelaunch` lands at site-packages' top level, where the generic names of the
folders would clash with other distributions. Everything else is in pyproject.toml.
"""

from setuptools import find_packages, setup

PARTS = ("model", "kernels", "parallel", "cluster", "launcher")

setup(
    packages=[
        f"moelaunch.{name}"
        for part in PARTS
        for name in (part, *(f"{part}.{sub}" for sub in find_packages(part)))
    ],
    package_dir={f"moelaunch.{part}": part for part in PARTS},
)
