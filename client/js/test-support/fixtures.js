// A reader for the wire fixtures (wire-fixtures/*.txt), written from the format section of
// wire-fixtures/README.md. It only parses: the tests decide what to check. It lives outside
// test/ because Node's test runner would run every .js file under a test/ directory.

import { readFileSync, readdirSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import path from 'node:path';

/** The repository's wire-fixtures directory (client/js/test-support -> ../../../wire-fixtures). */
export const FIXTURES_DIR = fileURLToPath(new URL('../../../wire-fixtures/', import.meta.url));

/**
 * One step of a fixture.
 * @typedef {{ line: number, connection: string | null, verb: string, bytes?: Buffer,
 *   words: string[] }} Step
 */

/**
 * The token `$token` and `$token-length` stand for in fixtures that require one: a runner is
 * given the server's; this reader only parses, so any token does.
 */
export const FIXTURE_TOKEN = Buffer.from('a token for the fixture reader');

/** @returns {string[]} every fixture's name, sorted */
export function fixtureNames() {
  return readdirSync(FIXTURES_DIR)
    .filter((name) => name.endsWith('.txt'))
    .map((name) => name.slice(0, -'.txt'.length))
    .sort();
}

const BYTE_VERBS = new Set(['send', 'send-bytewise', 'expect']);
const CONNECTION = /^[A-Za-z][A-Za-z0-9_-]*$/;

/**
 * Parses one fixture file into steps.
 * @param {string} name the fixture's name, without `.txt`
 * @returns {Step[]}
 */
export function readFixture(name) {
  const file = path.join(FIXTURES_DIR, `${name}.txt`);
  const lines = readFileSync(file, 'latin1').split(/\r?\n/);
  /** @type {{ line: number, words: string[] }[]} */
  const raw = [];
  lines.forEach((text, index) => {
    const code = text.split('#', 1)[0]; // '#' never occurs inside a "text" item
    const words = code.trim().split(/\s+/).filter(Boolean);
    if (words.length === 0) return; // blank or comment-only, indented or not
    if (/^[ \t]/.test(code)) {
      if (raw.length === 0) throw formatError(name, index + 1, 'continuation before any step');
      raw.at(-1).words.push(...words);
    } else {
      raw.push({ line: index + 1, words });
    }
  });
  // A `requires token` or `requires no-token` line, before the steps, is a header, not a step.
  return raw.filter(({ words }) => words[0] !== 'requires')
    .map(({ line, words }) => toStep(name, line, words));
}

function toStep(name, line, words) {
  // `wait` is a step of its own, not a connection: the README does not reserve the word, but
  // every fixture uses it as `wait Nms`.
  if (words[0] === 'wait') return { line, connection: null, verb: 'wait', words: words.slice(1) };
  const [connection, verb, ...rest] = words;
  if (!CONNECTION.test(connection) || verb === undefined) {
    throw formatError(name, line, `not a step: ${words.join(' ')}`);
  }
  const step = { line, connection, verb, words: rest };
  if (BYTE_VERBS.has(verb)) step.bytes = parseBytes(name, line, rest);
  return step;
}

const ITEM = /^(?:"([^"]*)"|([0-9A-Fa-f]+))(?:\*(\d+))?$/;
const GROUP_END = /^\)\*(\d+)$/;

/**
 * The bytes of an item list: hex, "text", ITEM*N and ( ITEMS )*N (no nesting).
 * @param {string} name @param {number} line @param {string[]} words
 * @returns {Buffer}
 */
export function parseBytes(name, line, words) {
  const parts = [];
  let group = null;
  for (const word of words) {
    if (word === '(') {
      if (group) throw formatError(name, line, 'nested (');
      group = [];
      continue;
    }
    const end = GROUP_END.exec(word);
    if (end) {
      if (!group) throw formatError(name, line, `${word} without (`);
      const once = Buffer.concat(group);
      parts.push(repeat(once, Number(end[1])));
      group = null;
      continue;
    }
    const bytes = parseItem(name, line, word);
    (group ?? parts).push(bytes);
  }
  if (group) throw formatError(name, line, '( without )*N');
  return Buffer.concat(parts);
}

function parseItem(name, line, word) {
  if (word === '$token') return FIXTURE_TOKEN;
  if (word === '$token-length') {
    const length = Buffer.alloc(2);
    length.writeUInt16BE(FIXTURE_TOKEN.length);
    return length;
  }
  const match = ITEM.exec(word);
  if (!match) throw formatError(name, line, `not a byte item: ${word}`);
  const [, text, hex, times] = match;
  let bytes;
  if (text !== undefined) {
    bytes = Buffer.from(text, 'latin1');
  } else {
    if (hex.length % 2 !== 0) throw formatError(name, line, `odd number of hex digits: ${word}`);
    bytes = Buffer.from(hex, 'hex');
  }
  return times === undefined ? bytes : repeat(bytes, Number(times));
}

function repeat(bytes, times) {
  return Buffer.concat(Array.from({ length: times }, () => bytes));
}

function formatError(name, line, message) {
  return new Error(`wire-fixtures/${name}.txt line ${line}: ${message}`);
}

/**
 * Everything each connection of a fixture sends (send and send-bytewise steps) and expects,
 * each as one stream in file order.
 * @param {Step[]} steps
 * @returns {Map<string, { sent: Buffer, expected: Buffer }>}
 */
export function streamsByConnection(steps) {
  const streams = new Map();
  for (const step of steps) {
    if (!step.bytes) continue;
    const entry = streams.get(step.connection) ?? { sent: [], expected: [] };
    streams.set(step.connection, entry);
    (step.verb === 'expect' ? entry.expected : entry.sent).push(step.bytes);
  }
  return new Map([...streams].map(([connection, { sent, expected }]) => [
    connection, { sent: Buffer.concat(sent), expected: Buffer.concat(expected) },
  ]));
}
