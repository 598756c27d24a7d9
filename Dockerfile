# The qvd image, built from files of this machine only (there is no registry to pull a base
# image from): scripts/docker-context.sh puts the binary, the shared libraries it links and
# the dynamic loader into build/docker/rootfs, and this copies them into an empty image.
# The binary is linked dynamically (cgo: OpenBLAS, later NVML, whose library must be the
# driver's own at run time, so it is never linked statically).
#   scripts/docker-context.sh && docker build -t qvd:local .
FROM scratch
COPY build/docker/rootfs/ /
ENV TMPDIR=/tmp
ENTRYPOINT ["/qvd"]
CMD ["help"]
