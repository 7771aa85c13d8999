// Markdown for model output: marked parses, DOMPurify sanitises (model text is untrusted: no scripts,
// no event handlers), highlight.js colours code blocks in the languages registered below.
import { marked } from './vendor/marked/marked.esm.js';
import DOMPurify from './vendor/dompurify/purify.es.mjs';
import hljs from './vendor/highlight/core.min.js';
import bash from './vendor/highlight/languages/bash.min.js';
import cpp from './vendor/highlight/languages/cpp.min.js';
import diff from './vendor/highlight/languages/diff.min.js';
import go from './vendor/highlight/languages/go.min.js';
import javascript from './vendor/highlight/languages/javascript.min.js';
import json from './vendor/highlight/languages/json.min.js';
import python from './vendor/highlight/languages/python.min.js';
import rust from './vendor/highlight/languages/rust.min.js';
import sql from './vendor/highlight/languages/sql.min.js';
import typescript from './vendor/highlight/languages/typescript.min.js';
import xml from './vendor/highlight/languages/xml.min.js';
import yaml from './vendor/highlight/languages/yaml.min.js';

const LANGUAGES = { bash, cpp, diff, go, javascript, json, python, rust, sql, typescript, xml, yaml };
for (const [name, grammar] of Object.entries(LANGUAGES)) hljs.registerLanguage(name, grammar);
hljs.configure({ ignoreUnescapedHTML: true });

marked.setOptions({ gfm: true, breaks: false });

DOMPurify.addHook('afterSanitizeAttributes', (node) => {
  if (node.tagName === 'A') {
    node.setAttribute('target', '_blank');
    node.setAttribute('rel', 'noopener noreferrer');
  }
});

/** Renders markdown `text` into `element` (sanitised), highlighting code blocks once `final`. */
export function renderMarkdown(element, text, final) {
  const html = marked.parse(text);
  element.innerHTML = DOMPurify.sanitize(html, { USE_PROFILES: { html: true } });
  if (!final) return;
  for (const block of element.querySelectorAll('pre code')) {
    const lang = [...block.classList].find((c) => c.startsWith('language-'));
    if (lang && !hljs.getLanguage(lang.slice(9))) continue; // a language not shipped: leave it plain
    hljs.highlightElement(block);
  }
}
