# The SMG gateway (PyPI `smg`, a Rust binary) for the compose override and deploy/k8s/smg.yaml.
FROM python:3.11-slim
RUN pip install --no-cache-dir smg==1.13.0 \
    && useradd --uid 10001 --create-home smg
USER 10001
EXPOSE 8000
ENTRYPOINT ["smg"]
CMD ["launch", "--help"]
