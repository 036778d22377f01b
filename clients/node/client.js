// zerogap gRPC client example for Node.js (@grpc/grpc-js + @grpc/proto-loader).
//
//   npm ci && node client.js [host:port]        (default localhost:50051)
//
// The stubs are built from ../../proto at start (nothing generated is committed).
// It runs: a health check, a greedy chat Generate, a GenerateStream printing deltas
// as they arrive, a JSON-schema constrained request, an error, a deadline, then a chat
// message with an image part (an 8x8 PNG; a text-only model answers FAILED_PRECONDITION).
'use strict';

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_DIR = path.join(__dirname, '..', '..', 'proto');
const PERSON_SCHEMA = {
  type: 'object',
  properties: {
    name: { type: 'string', maxLength: 16 },
    age: { type: 'integer', minimum: 0, maximum: 150 },
  },
  required: ['name', 'age'],
  additionalProperties: false,
};
// An 8x8 red PNG: an image part carries the file's raw bytes (PNG, JPEG or WebP).
const RED_PNG = Buffer.from(
  'iVBORw0KGgoAAAANSUhEUgAAAAgAAAAICAIAAABLbSncAAAAFUlEQVR42mM8ISfHgA0wMeAAg1MCANDKARQfGKMRAAAAAElFTkSuQmCC', 'base64');

function loadStubs() {
  const definition = protoLoader.loadSync(
    ['zerogap/v1/generation.proto', 'grpc/health/v1/health.proto'],
    { includeDirs: [PROTO_DIR], enums: String, longs: Number, defaults: true, oneofs: true },
  );
  return grpc.loadPackageDefinition(definition);
}

// Unary calls as promises; `deadlineMs` sets the call's deadline.
function unary(client, method, request, deadlineMs = 120000) {
  return new Promise((resolve, reject) => {
    client[method](request, { deadline: Date.now() + deadlineMs }, (err, response) =>
      err ? reject(err) : resolve(response));
  });
}

function statusName(code) {
  return Object.keys(grpc.status).find((k) => grpc.status[k] === code) || String(code);
}

async function main() {
  const target = process.argv[2] || process.env.ZEROGAP_ADDR || 'localhost:50051';
  const proto = loadStubs();
  const options = { 'grpc.max_receive_message_length': 64 << 20, 'grpc.keepalive_time_ms': 30000 };
  const creds = grpc.credentials.createInsecure();
  const gen = new proto.zerogap.v1.Generation(target, creds, options);
  const health = new proto.grpc.health.v1.Health(target, creds, options);

  // 1. Health check of the whole server ("" service).
  const h = await unary(health, 'Check', { service: '' }, 5000);
  console.log(`health: ${h.status}`);

  // 2. Chat, greedy (temperature 0).
  const chat = { messages: [{ role: 'user', content: 'Name three colors.' }] };
  const r = await unary(gen, 'Generate', { chat, sampling: { maxNewTokens: 24, temperature: 0 } });
  console.log(`generate: ${JSON.stringify(r.text)} finish=${r.finishReason} tokens=${r.usage.completionTokens}`);

  // 3. Streaming: print each delta the moment it arrives.
  const stream = gen.GenerateStream(
    { text: 'Once upon a time', sampling: { maxNewTokens: 48, temperature: 0 } },
    { deadline: Date.now() + 120000 },
  );
  let last;
  for await (const delta of stream) {
    console.log(`delta: ${JSON.stringify(delta.text)}`);
    last = delta;
  }
  console.log(`stream-done: finish=${last.finishReason} tokens=${last.usage.completionTokens}`);

  // 4. Constrained decoding: the output validates against a JSON Schema.
  const j = await unary(gen, 'Generate', {
    text: 'A person as JSON:',
    sampling: { maxNewTokens: 48, temperature: 0 },
    constraint: { jsonSchema: JSON.stringify(PERSON_SCHEMA) },
  });
  const person = JSON.parse(j.text);
  console.log(`json: ${JSON.stringify(person)}`);

  // 5. A status error: an empty prompt is INVALID_ARGUMENT, naming the field.
  try {
    await unary(gen, 'Generate', { text: '', sampling: { maxNewTokens: 4 } });
    console.log('error: none');
  } catch (err) {
    console.log(`error: ${statusName(err.code)} ${err.details}`);
  }

  // 6. A deadline: a long generation with a 300 ms deadline is cut off (the server
  //    aborts the request and frees its memory).
  try {
    await unary(gen, 'Generate', { text: 'Count to a thousand:', sampling: { maxNewTokens: 2000, ignoreEos: true } }, 300);
    console.log('deadline: none');
  } catch (err) {
    console.log(`deadline: ${statusName(err.code)}`);
  }

  // 7. An image in a chat message: parts in order, text and images.
  try {
    const parts = [{ text: 'What color is this picture? ' }, { image: RED_PNG }];
    const m = await unary(gen, 'Generate', {
      chat: { messages: [{ role: 'user', parts }] }, sampling: { maxNewTokens: 8, temperature: 0 },
    });
    console.log(`image: OK ${JSON.stringify(m.text)}`);
  } catch (err) {
    console.log(`image: ${statusName(err.code)} ${err.details}`);
  }

  gen.close();
  health.close();
}

main().catch((err) => {
  console.error(`failed: ${err.code !== undefined ? statusName(err.code) : ''} ${err.details || err.stack}`);
  process.exit(1);
});
