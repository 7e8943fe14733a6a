// The client against real servers with a token and TLS: the `token` and `tls` options, the
// PINPRIQ_AUTH_TOKEN default, and the errors of a client that does not belong.

import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';

import { PinpriqClient, PinpriqConnectionError, encodeAuth } from '../index.js';
import { makeCertificates } from '../test-support/certificates.js';
import { waitFor } from '../test-support/helpers.js';
import { startServer } from '../test-support/server.js';

const TOKEN = 'js t0ken';

describe('a server with a token and TLS', () => {
  let server;
  let tls;
  before(async () => {
    const files = makeCertificates();
    tls = { ca: files.ca };
    server = await startServer({
      args: ['--tls-cert', files.cert, '--tls-key', files.key],
      env: { PINPRIQ_AUTH_TOKEN: TOKEN },
    });
  });
  after(() => server.stop());

  test('takes the token and TLS: push, pop and subscribe', async () => {
    const client = await PinpriqClient.connect({ port: server.port, token: TOKEN, tls });
    try {
      await client.push('js-tls', 'k', 'v', { confirm: true });
      const [packet] = await client.pop('js-tls');
      assert.equal(packet.key.toString(), 'k');
      await client.push('js-tls-sub', 'k2', 'v2');
      const subscription = await client.subscribe('js-tls-sub', { limit: 1 });
      const deliveries = [];
      for await (const delivery of subscription) deliveries.push(delivery[0].key.toString());
      assert.deepEqual(deliveries, ['k2']);
    } finally {
      await client.close();
    }
  });

  test('reads the token from PINPRIQ_AUTH_TOKEN by default', async () => {
    process.env.PINPRIQ_AUTH_TOKEN = TOKEN;
    try {
      const client = await PinpriqClient.connect({ port: server.port, tls });
      assert.deepEqual(await client.pop('js-tls-none'), []);
      await client.close();
    } finally {
      delete process.env.PINPRIQ_AUTH_TOKEN;
    }
  });

  test('a wrong token fails at connect, saying so', async () => {
    await assert.rejects(
      PinpriqClient.connect({ port: server.port, token: 'wrong', tls }),
      (error) => error instanceof PinpriqConnectionError
        && error.message === `127.0.0.1:${server.port} closed the connection in answer to auth: `
          + 'it does not take this token (or speaks protocol 1.0, which has no auth)',
    );
  });

  test('a plain client with the right token is told the port may speak TLS', async () => {
    // Closed at once: a token the server refuses is closed after about half a second.
    await assert.rejects(
      PinpriqClient.connect({ port: server.port, token: TOKEN }),
      (error) => error instanceof PinpriqConnectionError
        && error.message.startsWith(`127.0.0.1:${server.port}: the server closed the connection `
          + 'at once, without judging the token (it may speak TLS only, which this client did not; '),
    );
  });

  test('a CA the client does not trust fails at connect', async () => {
    await assert.rejects(
      PinpriqClient.connect({ port: server.port, token: TOKEN, tls: true }),
      (error) => error instanceof PinpriqConnectionError
        && error.message.startsWith(`cannot connect to 127.0.0.1:${server.port}: TLS handshake`),
    );
  });

  test('a plain client is closed at once', async () => {
    const client = await PinpriqClient.connect({ port: server.port, token: null });
    await assert.rejects(client.pop('q'), /closed the connection at once .*want a token or TLS/);
    client.destroy();
  });
});

test('TLS to a plain server fails at connect', async () => {
  const server = await startServer();
  const files = makeCertificates();
  try {
    await assert.rejects(
      PinpriqClient.connect({ port: server.port, token: null, tls: { ca: files.ca } }),
      (error) => error instanceof PinpriqConnectionError
        && error.message.startsWith(`cannot connect to 127.0.0.1:${server.port}: `),
    );
    // The server logs one line about it, and carries on.
    const line = /unknown opcode 0x16 at stream offset 0 \(a TLS handshake\?/;
    await waitFor(() => line.test(server.log()), 'the log line');
    const plain = await PinpriqClient.connect({ port: server.port, token: null });
    assert.deepEqual(await plain.pop('q'), []);
    await plain.close();
  } finally {
    await server.stop();
  }
});

test('the options are checked', async () => {
  await assert.rejects(PinpriqClient.connect({ token: 5 }), TypeError);
  await assert.rejects(PinpriqClient.connect({ tls: 'yes' }), TypeError);
  assert.deepEqual([...encodeAuth('ab')], [0x61, 0x00, 0x02, 0x61, 0x62]);
});
