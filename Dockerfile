# pinpriq-server in a slim image, listening on every interface of the container.
FROM python:3.11-slim

RUN useradd --create-home --uid 10001 pinpriq
WORKDIR /opt/pinpriq
COPY pyproject.toml README.md ./
COPY pinpriq ./pinpriq
# wire-fixtures/ is package data (pinpriq.fixtures): pinpriq-conformance reads it in the image.
COPY wire-fixtures ./wire-fixtures
RUN pip install --no-cache-dir . && rm -rf /opt/pinpriq/build

USER pinpriq
EXPOSE 7000
ENTRYPOINT ["pinpriq-server"]
CMD ["--host", "0.0.0.0", "--port", "7000"]
