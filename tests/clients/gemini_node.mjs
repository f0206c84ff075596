// @google/genai (Google's Gen AI Node SDK) through holdfast, unmodified but for its base URL
// (issue 31, SPEC GM-1..GM-5).
//
// Usage: node gemini_node.mjs MODE, with HOLDFAST_URL set to holdfast's address (no version: the
// SDK adds /v1beta itself).
//   surface -- generateContent, generateContentStream, countTokens, models.list, models.get,
//              then generateContent again (a re-send); print texts, the count and model names
//   retry   -- generateContent with timeout: 1000 and retryOptions { attempts: 3 } against a
//              provider slower than that; print the text or the error
//   cut     -- generateContentStream while the provider drops mid-stream; print the text read
//              and the error the SDK threw
// Every mode prints one JSON object on stdout.
import { GoogleGenAI } from '@google/genai';

const url = process.env.HOLDFAST_URL;
const mode = process.argv[2];
const model = 'gemini-2.5-flash';

function client(httpOptions = {}) {
  return new GoogleGenAI({ apiKey: 'unused-by-holdfast', httpOptions: { baseUrl: url, ...httpOptions } });
}

const out = {};
if (mode === 'surface') {
  const ai = client();
  out.text = (await ai.models.generateContent({ model, contents: 'gemini node' })).text;
  out.stream_text = '';
  for await (const chunk of await ai.models.generateContentStream({ model, contents: 'gemini node stream' })) {
    out.stream_text += chunk.text ?? '';
  }
  out.total_tokens = (await ai.models.countTokens({ model, contents: 'count these tokens' })).totalTokens;
  out.models = [];
  for await (const m of await ai.models.list()) {
    out.models.push(m.name);
  }
  out.one_model = (await ai.models.get({ model: 'gemini-mock-small' })).name;
  out.again = (await ai.models.generateContent({ model, contents: 'gemini node' })).text;
} else if (mode === 'retry') {
  const ai = client({ timeout: 1000, retryOptions: { attempts: 3, initialDelay: 0.2, maxDelay: 0.5 } });
  try {
    out.text = (await ai.models.generateContent({ model, contents: 'gemini node retry' })).text;
  } catch (e) {
    out.error = `${e?.name}: ${e?.message}`;
  }
} else if (mode === 'cut') {
  const ai = client();
  out.text = '';
  try {
    for await (const chunk of await ai.models.generateContentStream({ model, contents: 'gemini node cut' })) {
      out.text += chunk.text ?? '';
    }
  } catch (e) {
    out.error = { name: e?.name, status: e?.status ?? null, message: String(e?.message) };
  }
} else {
  console.error(`unknown mode ${mode}`);
  process.exit(2);
}
console.log(JSON.stringify(out));
