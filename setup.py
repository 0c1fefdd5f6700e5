"""Which packages the wheel holds: found, never listed by hand.

Everything under sarazmq/ is found by `find_packages`; the design's two top-level folders
kernels/ and procs/ (and anything that grows under them) are installed as sarazmq.kernels
and sarazmq.procs. The rest of the metadata is in pyproject.toml.
"""

from setuptools import find_packages, setup

#: top-level folders installed inside the sarazmq namespace
MAPPED_FOLDERS = {"sarazmq.kernels": "kernels", "sarazmq.procs": "procs"}

packages = find_packages(include=["sarazmq", "sarazmq.*"])
package_dir = {}
for name, folder in MAPPED_FOLDERS.items():
    packages.append(name)
    package_dir[name] = folder
    for sub in find_packages(folder):
        packages.append(f"{name}.{sub}")
        package_dir[f"{name}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"

setup(packages=packages, package_dir=package_dir)
