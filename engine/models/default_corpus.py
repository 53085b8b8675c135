"""The fixed text the default model's byte-level BPE is trained on (changing it changes
the tokenizer: bump DEFAULT_MODEL_DIRNAME in default_model.py)."""

CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with one step.
In the morning the harbour was quiet; fishing boats rocked gently while gulls circled overhead,
and the smell of salt, tar and fresh bread drifted along the narrow streets toward the market.
She opened the old wooden box and found letters, photographs, a silver key and a map of islands
that nobody in the family had ever visited. "Where did these come from?" her brother asked.
Science is a way of thinking much more than it is a body of knowledge. Researchers measure, test
and compare; they publish results, argue about them, and slowly build models that predict what
happens next. Good experiments are repeatable: another laboratory should see the same effect.
To bake simple bread, mix 500 grams of flour, 350 millilitres of warm water, 10 grams of salt and
7 grams of yeast. Knead for ten minutes, let the dough rise for two hours, then bake at 230 degrees.
The history of computing runs from mechanical calculators to transistors, integrated circuits and
the networks that connect billions of devices. Early programmers wrote machine code by hand;
later languages such as Fortran, Lisp, C, Python and Rust made programs easier to write and to
reason about.
A language model reads a sequence of tokens and predicts the next one. During inference the server
keeps the attention keys and values of earlier tokens in a cache, schedules many requests together,
and streams each new token back to the client as soon as it has been sampled from the distribution.
Weather report: cloudy with occasional showers in the north, sunny intervals in the south, winds
from the west at 20 km/h. Temperatures between 12 and 18 degrees Celsius; tomorrow will be warmer.
Meeting notes, Tuesday 14 March 2023: the team agreed to ship version 2.4.1 before Friday, to fix
the memory leak reported in issue #4821, and to review the budget of $12,500 for new hardware.
Dear customer, thank you for your order. Your package will arrive within 3-5 business days.
If you have any questions, please contact our support team at support@example.com or call us.
Once upon a time, in a kingdom between the mountains and the sea, there lived a clever princess
who preferred books to balls. Every evening she climbed the tower to watch the stars and write
down their positions, hoping one day to sail beyond the horizon and see the world for herself.
Questions and answers: What is the capital of France? Paris. How many legs does a spider have?
Eight. Why is the sky blue? Because air scatters short wavelengths of sunlight more than long ones.
def fibonacci(n: int) -> list[int]:
    values = [0, 1]
    while len(values) < n:
        values.append(values[-1] + values[-2])
    return values[:n]

class Counter:
    def __init__(self, start=0):
        self.count = start

    def increment(self, step=1):
        self.count += step
        return self.count

for i in range(10):
    if i % 2 == 0:
        print(f"{i} is even")
    else:
        print(f"{i} is odd")

import json
data = {"name": "example", "values": [1, 2, 3], "enabled": true, "ratio": 0.75}
with open("config.json", "w") as handle:
    json.dump(data, handle, indent=2)

SELECT id, name, created_at FROM users WHERE active = 1 ORDER BY created_at DESC LIMIT 20;
$ git clone https://github.com/example/project.git && cd project && make test
fn main() { let total: u64 = (1..=100).sum(); println!("total = {}", total); }
function add(a, b) { return a + b; } const result = add(40, 2); console.log(result);
<html><body><h1>Hello, world!</h1><p>This is a paragraph.</p></body></html>
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 25 30 42 64 99 100 128 256 512 1000
1024 2048 4096 65536 3.14159 2.71828 1.41421 -7 +12 1e-5 0.001 99.9% 2024-01-15 12:30:45 v1.2.3
Math: 2 + 2 = 4, 7 * 6 = 42, 100 / 4 = 25, 3^2 = 9, sqrt(16) = 4, x = (a + b) * c - d / e.
Punctuation and symbols: (parentheses) [brackets] {braces} <angles> 'quotes' "double" a|b a&b
~tilde `backtick` @at #hash $dollar %percent ^caret *star _under -dash +plus =equals \\slash /.
Autumn leaves fell across the path as the travellers walked north. They carried bread, cheese,
apples and water, and they told stories to pass the time: stories about dragons, ships, storms,
lost cities, honest merchants, brave children and wise old women who knew the names of all plants.
The committee will consider the proposal carefully. However, several members expressed concerns
about the cost, the timeline and the environmental impact, so further analysis is required.
Please remember: always check your inputs, handle errors clearly, write tests, and document why.
Doctors recommend regular exercise, enough sleep, plenty of vegetables and fruit, and less sugar.
A balanced diet includes protein from beans, fish, eggs or meat, whole grains, nuts and olive oil.
The orchestra tuned its instruments; violins, cellos, flutes, trumpets and drums filled the hall
with a symphony in three movements, slow, lively and triumphant, followed by long applause.
In the final minute the striker received the ball, dribbled past two defenders and scored; the
crowd cheered, the coach jumped, and the team won the championship for the first time in decades.
Economists study markets, prices, wages, inflation, interest rates, trade and unemployment. When
demand rises faster than supply, prices usually increase; central banks may then raise interest.
Travel tips: pack light, carry a passport copy, learn a few local phrases, drink bottled water,
respect customs, and keep an emergency contact. Trains are often faster than planes for short trips.
Gardeners plant tomatoes, peppers, lettuce, carrots, potatoes, onions, garlic, herbs and flowers;
they water them in the evening, pull weeds, and harvest vegetables throughout the summer season.
The museum's new exhibition shows paintings, sculptures, ancient pottery, coins, jewellery, tools
and manuscripts, explaining how people lived, worked, worshipped and traded thousands of years ago.
Operating systems manage processes, threads, memory, files, devices and permissions; a scheduler
decides which thread runs next, and virtual memory maps pages to physical frames on demand.
Bonjour, comment allez-vous? Je vais bien, merci. Guten Morgen, wie geht es Ihnen? Sehr gut, danke.
Hola, ¿qué tal? Muy bien, gracias. こんにちは、元気ですか。你好。今天天气很好。Привет, как дела?
Chemistry describes atoms, molecules, electrons, bonds and reactions: hydrogen and oxygen combine
to form water, carbon dioxide dissolves in oceans, and catalysts speed up reactions without change.
#include <stdio.h>
int main(void) { for (int k = 0; k < 8; ++k) { printf("%d\n", k * k); } return 0; }
package main; import "fmt"; func main() { fmt.Println("hello from go", 3*7) }
server: {host: 0.0.0.0, port: 8080, workers: 4, timeout_seconds: 30, log_level: info}
try:
    value = int(text)
except ValueError as error:
    raise RuntimeError(f"could not parse {text!r}") from error
assert sorted([3, 1, 2]) == [1, 2, 3] and max(4, 9) == 9 and "abc".upper() == "ABC"
"""
